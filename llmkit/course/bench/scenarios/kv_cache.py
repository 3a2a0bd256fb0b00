"""The KV cache beyond one slot: a long prefix back from the host-RAM prompt cache; an edited chat with cache reuse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmkit.course.bench.levels import ttft
from llmkit.course.bench.servers import OpenAIServer, http_client
from llmkit.course.client import StreamResult

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class KvCache:
    """First-token times of one long prefix read cold, again on its slot, and back from RAM on the other slot;
    and the share of an edited chat read again."""

    server: str
    cold_ms: float
    same_slot_ms: float
    ram_ms: float
    ram_cached_tokens: int | None  # the prompt tokens the request from RAM found cached
    chat_tokens: int  # the edited chat's prompt tokens
    edited_read_share: float | None  # of them, the share read again (None: the server did not say)


async def kv_cache(server: OpenAIServer, prefix: str, history: list[dict], shortened: list[dict]) -> KvCache:
    """On a server with 2 slots and ``--cache-reuse``: first-token times of a long ``prefix`` read cold,
    again on the same slot, and back from RAM on the other slot (two unrelated prompts took both slots
    in between); then ``history`` and the same chat with an early message ``shortened``: the share of
    the prompt read again."""
    async with http_client(1) as http:

        async def first_token(system: str, question: str) -> StreamResult:
            return await server.stream(http, server.request(question, 1, system=system))

        cold = await first_token(prefix, "Which item is on shelf 3?")
        same_slot = await first_token(prefix, "Which item is on shelf 4?")
        for other in ("A recipe for bread: flour, water and salt.", "The rules of chess, in one line."):
            await first_token(other, "Go on.")
        from_ram = await first_token(prefix, "Which item is on shelf 5?")
        await server.stream(http, server.chat_request(history, 1))
        edited = await server.stream(http, server.chat_request(shortened, 1))
    timings = (edited.final or {}).get("timings") or {}
    n_prompt = timings.get("cache_n", 0) + timings.get("prompt_n", 0)
    return KvCache(
        server=server.name,
        cold_ms=ttft(cold) * 1e3,
        same_slot_ms=ttft(same_slot) * 1e3,
        ram_ms=ttft(from_ram) * 1e3,
        ram_cached_tokens=from_ram.cached_tokens,
        chat_tokens=n_prompt,
        edited_read_share=timings.get("prompt_n", 0) / n_prompt if n_prompt else None,
    )
