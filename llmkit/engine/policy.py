"""The scheduling ``Policy``: which waiting request goes first, which slot it gets, which running job makes room for it,
whose prompt fills a step first. Four pure decisions over the queue and the slots, which the ``Scheduler`` applies
(checked: a policy that raises or answers what cannot be done costs its own decision, never a request).

llama-server's rules are the default (``LlamaServerPolicy``, with ``choose_slot`` ~ ``get_available_slot``); a policy
of your own replaces them (``EngineConfig(policy=...)``, or ``--scheduling-policy package.module:Class``). A policy may
keep state, and hears what happened through two hooks that do nothing by default (``observe``, ``finished``):

    class Mine(LlamaServerPolicy):                        # keep llama-server's slot choice, change the order
        name = "mine"
        def order(self, waiting, slots): return sorted(waiting, key=lambda r: r.params.max_tokens)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol

from llmkit.engine.job import Job
from llmkit.engine.request import Outcome, Request, RequestParams
from llmkit.engine.slot import Slot
from llmkit.engine.tokens import common_prefix

if TYPE_CHECKING:
    from llmkit.engine.steps import StepRecord

SIMILARITY_THRESHOLD = 0.1  # llama-server's --slot-prompt-similarity default


class Running(NamedTuple):
    """A busy slot and the job on it."""

    slot: Slot
    job: Job


class Policy(Protocol):
    """How the engine schedules: four pure decisions, which the engine applies (``admission``, ``build_batch``)."""

    name: ClassVar[str]

    def order(self, waiting: Sequence[Request], slots: Sequence[Slot]) -> list[Request]:
        """The waiting requests, in the order they are offered a slot. ``slots``: the KV cache's sequences, the slots and
        after them, with ``kv_share``, the resident prefixes (never busy; ``choose_slot`` gets the slots alone)."""
        ...

    def choose_slot(self, slots: Sequence[Slot], request: Request, tokens: list[int]) -> Slot | None:
        """An idle slot for ``request``, which needs ``tokens`` in its KV cache (its prompt; after a preemption, its
        prompt and what it generated), or None: it waits."""
        ...

    def victim(self, slots: Sequence[Slot], request: Request) -> Slot | None:
        """A busy slot whose job leaves it for ``request`` (preemption: the job waits and goes on later), or None."""
        ...

    def prompt_order(self, reading: Sequence[Running]) -> list[Running]:
        """The jobs still reading their prompts, in the order their chunks fill a step."""
        ...

    def observe(self, step: StepRecord) -> None:
        """What a step did (after it): a policy that keeps history hears it here."""
        ...

    def finished(self, request: Request, result: Outcome | BaseException) -> None:
        """A request ended (its outcome, or the error it failed with), whether or not it ever got a slot."""
        ...


class LlamaServerPolicy:
    """llama-server's rules, the default: first come first served (``process_single_task``: a request whose slot is busy
    waits, the next one goes on), ``get_available_slot``'s choice, no preemption; prompts in arrival order
    (llmkit's one change: llama-server reads them in slot order, so a later request in a lower slot goes first)."""

    name: ClassVar[str] = "llama-server"

    def order(self, waiting: Sequence[Request], slots: Sequence[Slot]) -> list[Request]:
        return list(waiting)

    def choose_slot(self, slots: Sequence[Slot], request: Request, tokens: list[int]) -> Slot | None:
        return choose_slot(slots, request.params, tokens)

    def victim(self, slots: Sequence[Slot], request: Request) -> Slot | None:
        return None

    def prompt_order(self, reading: Sequence[Running]) -> list[Running]:
        return sorted(reading, key=lambda running: running.job.request.id)

    def observe(self, step: StepRecord) -> None:
        pass

    def finished(self, request: Request, result: Outcome | BaseException) -> None:
        pass


class ShortestPromptFirst(LlamaServerPolicy):
    """The shortest prompt first, in the queue and in a step (ties: arrival): short requests stop waiting behind long
    ones; a long one can wait while short ones keep coming."""

    name: ClassVar[str] = "shortest-prompt"

    def order(self, waiting: Sequence[Request], slots: Sequence[Slot]) -> list[Request]:
        return sorted(waiting, key=lambda request: len(request.prompt))

    def prompt_order(self, reading: Sequence[Running]) -> list[Running]:
        return sorted(reading, key=lambda running: (len(running.job.prompt_left), running.job.request.id))


class FairShare(LlamaServerPolicy):
    """Slots shared among tenants (``RequestParams.tenant``, the server's ``X-Tenant`` header): the waiting request whose
    tenant holds the fewest slots goes first (ties: arrival), so one tenant's burst cannot take every slot."""

    name: ClassVar[str] = "fair-share"

    def order(self, waiting: Sequence[Request], slots: Sequence[Slot]) -> list[Request]:
        held = Counter(slot.job.request.params.tenant for slot in slots if slot.job is not None)
        return sorted(waiting, key=lambda request: held[request.params.tenant])


class PriorityPolicy(LlamaServerPolicy):
    """``RequestParams.priority`` first (lower goes first, as vLLM's ``--scheduling-policy priority``; ties: arrival).
    When no slot is idle, a request takes the slot of the running job of the lowest priority below its own (the
    latest of them): that job waits, its KV cache saved, and goes on later (``Scheduler.preempt``)."""

    name: ClassVar[str] = "priority"

    def order(self, waiting: Sequence[Request], slots: Sequence[Slot]) -> list[Request]:
        return sorted(waiting, key=lambda request: request.params.priority)

    def victim(self, slots: Sequence[Slot], request: Request) -> Slot | None:
        def rank(slot: Slot) -> tuple[int, int]:
            assert slot.job is not None
            return slot.job.request.params.priority, slot.job.request.id

        below = [slot for slot in slots if slot.job is not None and slot.job.request.params.priority > request.params.priority]
        return max(below, key=rank, default=None)

    def prompt_order(self, reading: Sequence[Running]) -> list[Running]:
        return sorted(reading, key=lambda running: (running.job.request.params.priority, running.job.request.id))


class LongestPrefixMatch(LlamaServerPolicy):
    """SGLang's ``lpm``: the waiting request with the most of its prompt already in the KV cache goes first (any slot's
    cells, busy or idle, or a resident prefix's; ties: arrival), so what the cache holds is used before it is evicted. With ``kv_share`` the
    request takes those cells wherever they are; without, only from the slot it gets. A request with nothing cached
    can wait while cached ones keep coming (SGLang falls back to first come first served for long queues)."""

    name: ClassVar[str] = "lpm"

    def order(self, waiting: Sequence[Request], slots: Sequence[Slot]) -> list[Request]:
        return sorted(waiting, key=lambda request: -held_prefix(slots, request.prompt))


POLICIES: dict[str, type[LlamaServerPolicy]] = {
    p.name: p for p in (LlamaServerPolicy, ShortestPromptFirst, FairShare, PriorityPolicy, LongestPrefixMatch)
}


def choose_slot(slots: Sequence[Slot], params: RequestParams, tokens: list[int]) -> Slot | None:
    """Pick an idle slot for a request that needs ``tokens``, or None if it must wait.

    Mirrors llama-server's ``get_available_slot`` (server-context.cpp):
    the slot named by ``id_slot`` if any; else the idle slot whose cache
    shares the longest prefix with the prompt, if that covers more than 10 %
    of it; else the least recently used idle slot.
    """
    if params.id_slot is not None:
        slot = slots[params.id_slot]
        return slot if slot.is_idle else None
    idle = [s for s in slots if s.is_idle]
    if not idle:
        return None
    if params.cache_prompt:
        best = max(idle, key=lambda s: s.similarity(tokens))
        if best.similarity(tokens) > SIMILARITY_THRESHOLD:
            return best
    return min(idle, key=lambda s: s.t_last_used)


def held_prefix(slots: Sequence[Slot], tokens: list[int]) -> int:
    """The longest prefix of ``tokens`` that any of ``slots`` holds in its cells."""
    return max((common_prefix(slot.cache_tokens, tokens) for slot in slots), default=0)
