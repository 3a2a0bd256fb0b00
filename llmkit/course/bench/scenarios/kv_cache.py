"""The KV cache beyond one slot: a long prefix back from the host-RAM prompt cache; an edited chat with cache reuse."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from llmkit.course import launch
from llmkit.course.bench.config import CACHE_REUSE, Config
from llmkit.course.bench.prompts import edited_chat, long_system_prompt
from llmkit.course.bench.scenario import Scenario, Stage
from llmkit.course.bench.scenarios.levels import ttft
from llmkit.course.bench.servers import OpenAIServer, http_client, server_flags
from llmkit.course.bench.targets import Target, info, result_of, unmeasured
from llmkit.course.client import StreamResult


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


# --- in a bench run: the scenario (``llmkit.course.bench.scenario``) --------------------


def run(cfg: Config, stage: Stage) -> list[KvCache]:
    """The slot server and llama-server (unless skipped), each started alone with 2 slots and ``--cache-reuse``."""
    system = long_system_prompt(cfg.model, cfg.prefix_tokens)
    history, shortened = edited_chat(cfg.model, cfg.chat_tokens)
    out = []
    for kind in ("slots", "llama-server"):
        if kind not in cfg.skip:
            with launch.serve(kind, "-np", "2", "-c", "4096", "--cache-reuse", str(CACHE_REUSE), *server_flags(cfg)) as p:
                out.append(asyncio.run(kv_cache(OpenAIServer(kind, p.url), system, history, shortened)))
    return out


def table(results: list[KvCache]) -> str:
    head = "| server | cold first token | same slot | from RAM, other slot | cold / RAM | edited ~1,000-token chat: share read again |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in results:
        share = f"{100 * r.edited_read_share:.0f} %" if r.edited_read_share is not None else "n/a"
        lines.append(f"| {r.server} | {r.cold_ms:.0f} ms | {r.same_slot_ms:.0f} ms | {r.ram_ms:.0f} ms ({r.ram_cached_tokens} cached) | "
                     f"{r.cold_ms / r.ram_ms:.1f}x | {share} of {r.chat_tokens} |")  # fmt: skip
    return "\n".join(lines)


def section(results: list[KvCache], cfg: Config) -> str:
    return f"## KV cache beyond one slot (2 slots, --cache-reuse {CACHE_REUSE})\n\n" + table(results)


def targets(results: list[KvCache] | None, cfg: Config) -> list[Target]:
    return kv_cache_targets(results or [], cfg)


# The host-RAM prompt cache: a long prefix restored from RAM on another slot must give its first token at least 10 times
# sooner than reading it cold (copying its KV back is far cheaper than computing it).
FROM_RAM_SPEEDUP = 10


# Cache reuse (--cache-reuse): editing an early message of a long chat must not re-read it all; the chunks after the
# edit are shifted into place, and at most 15 % of the chat is read again.
EDITED_READ_SHARE = 0.15


def kv_cache_targets(caching: Sequence[KvCache], cfg: Config) -> list[Target]:
    """The prompt cache and cache reuse on the slot server; llama-server's numbers on the same requests for information."""
    ram = (f"slots prompt cache: a ~{cfg.prefix_tokens}-token prefix from RAM on another slot, "
           f"first token >= {FROM_RAM_SPEEDUP}x faster than cold")  # fmt: skip
    edited = (f"slots cache reuse: an edited early message in a ~{cfg.chat_tokens}-token chat "
              f"re-reads <= {100 * EDITED_READ_SHARE:.0f} % of it")  # fmt: skip
    if not (kv := result_of(caching, "slots")):
        return [unmeasured(ram), unmeasured(edited)]
    out = [Target(ram, f"{kv.cold_ms / kv.ram_ms:.1f}x", kv.cold_ms / kv.ram_ms >= FROM_RAM_SPEEDUP)]
    share = kv.edited_read_share
    out.append(unmeasured(edited) if share is None else Target(edited, f"{100 * share:.0f} %", share <= EDITED_READ_SHARE))
    if real := result_of(caching, "llama-server"):
        measured = f"RAM {real.cold_ms / real.ram_ms:.1f}x faster than cold; re-reads {100 * (real.edited_read_share or 0):.0f} %"
        out.append(info("prompt cache and cache reuse, llama-server (same requests)", measured))
    return out


SCENARIO = Scenario("kv-cache", run, section, targets)
