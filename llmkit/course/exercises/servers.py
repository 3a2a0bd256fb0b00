"""The servers the checks share (``LAB.server`` starts each once), with the flags the chapters use."""

from __future__ import annotations

from llmkit.course.exercises.lab import LAB
from llmkit.course.launch import ServerProcess

SLOT_FLAGS = ("-t", "1", "-np", "2", "-c", "4096")


def slots() -> ServerProcess:
    """The slot server: 2 slots of 2048 tokens, one thread (as the chapters start it)."""
    return LAB.server("slots", *SLOT_FLAGS)


def llama() -> ServerProcess:
    """The real llama-server with the same flags."""
    return LAB.server("llama-server", *SLOT_FLAGS)


def sequential() -> ServerProcess:
    """The sequential server, greedy, at most 48 tokens a translation."""
    return LAB.server("sequential", "--temp", "0", "-n", "48", "-t", "1")


def completions(url: str, prompts: list[list[int]], **fields: object) -> list[dict]:
    """``POST /completion`` for each token prompt in turn (llama-server's native route; the slot server has it too)."""
    import httpx

    return [httpx.post(f"{url}/completion", json={"prompt": prompt, **fields}, timeout=300).json() for prompt in prompts]


def both() -> dict[str, ServerProcess]:
    return {"slots": slots(), "llama-server": llama()}
