"""The decisions the engine makes: a scheduling ``Policy`` (which waiting request goes first, which slot it gets,
which running job makes room for it, whose prompt fills a step first), whether a prompt goes through the prompt
cache, and what goes in each step's batch.

They are pure functions over the queue and the slots: they change nothing, so they can be read (and tested)
on their own, and a policy of your own replaces llama-server's (``EngineConfig(policy=...)``, or ``--scheduling-policy``):

    class Mine(LlamaServerPolicy):                        # keep llama-server's slot choice, change the order
        name = "mine"
        def order(self, waiting, slots): return sorted(waiting, key=lambda r: r.params.max_tokens)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol

from llmkit.engine.job import Job
from llmkit.engine.request import Request, RequestParams
from llmkit.engine.slot import Slot, common_prefix

SIMILARITY_THRESHOLD = 0.1  # llama-server's --slot-prompt-similarity default
KEEP_THRESHOLD = 0.5  # get_available_slot: a slot about to lose over half of what it holds goes to the prompt cache first

Running = tuple[Slot, Job]  # a busy slot and the job on it


class Policy(Protocol):
    """How the engine schedules: four pure decisions, which the engine applies (``admission``, ``build_batch``)."""

    name: ClassVar[str]

    def order(self, waiting: Sequence[Request], slots: Sequence[Slot]) -> list[Request]:
        """The waiting requests, in the order they are offered a slot."""
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


@dataclass(frozen=True)
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
        return sorted(reading, key=lambda running: running[1].request.id)


@dataclass(frozen=True)
class ShortestPromptFirst(LlamaServerPolicy):
    """The shortest prompt first, in the queue and in a step (ties: arrival): short requests stop waiting behind long
    ones; a long one can wait while short ones keep coming."""

    name: ClassVar[str] = "shortest-prompt"

    def order(self, waiting: Sequence[Request], slots: Sequence[Slot]) -> list[Request]:
        return sorted(waiting, key=lambda request: len(request.prompt))

    def prompt_order(self, reading: Sequence[Running]) -> list[Running]:
        return sorted(reading, key=lambda running: (len(running[1].prompt_left), running[1].request.id))


@dataclass(frozen=True)
class FairShare(LlamaServerPolicy):
    """Slots shared among tenants (``RequestParams.tenant``, the server's ``X-Tenant`` header): the waiting request whose
    tenant holds the fewest slots goes first (ties: arrival), so one tenant's burst cannot take every slot."""

    name: ClassVar[str] = "fair-share"

    def order(self, waiting: Sequence[Request], slots: Sequence[Slot]) -> list[Request]:
        held = Counter(slot.job.request.params.tenant for slot in slots if slot.job is not None)
        return sorted(waiting, key=lambda request: held[request.params.tenant])


@dataclass(frozen=True)
class PriorityPolicy(LlamaServerPolicy):
    """``RequestParams.priority`` first (lower goes first, as vLLM's ``--scheduling-policy priority``; ties: arrival).
    When no slot is idle, a request takes the slot of the running job of the lowest priority below its own (the
    latest of them): that job waits, its KV cache saved, and goes on later (``Engine.preempt``)."""

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
        return sorted(reading, key=lambda running: (running[1].request.params.priority, running[1].request.id))


@dataclass(frozen=True)
class LongestPrefixMatch(LlamaServerPolicy):
    """SGLang's ``lpm``: the waiting request with the most of its prompt already in the KV cache goes first (any slot's
    cells, busy or idle; ties: arrival), so what the cache holds is used before it is evicted. With ``kv_share`` the
    request takes those cells wherever they are; without, only from the slot it gets. A request with nothing cached
    can wait while cached ones keep coming (SGLang falls back to first come first served for long queues)."""

    name: ClassVar[str] = "lpm"

    def order(self, waiting: Sequence[Request], slots: Sequence[Slot]) -> list[Request]:
        return sorted(waiting, key=lambda request: -held_prefix(slots, request.prompt))


POLICIES: dict[str, type[LlamaServerPolicy]] = {
    p.name: p for p in (LlamaServerPolicy, ShortestPromptFirst, FairShare, PriorityPolicy, LongestPrefixMatch)
}


class Admission(NamedTuple):
    """A waiting request and the slot it gets; with ``preempt``, the job on that slot leaves it first."""

    request: Request
    slot: Slot
    preempt: bool = False


def admission(
    waiting: Sequence[Request], slots: Sequence[Slot], policy: Policy, tokens: Callable[[Request], list[int]]
) -> Admission | None:
    """The next request to start, in the policy's order: the first that gets an idle slot; else the first that may
    take a busy one (llama-server: process_single_task, get_available_slot; it never preempts). None: all wait.
    ``tokens(request)``: what the request needs in its slot's KV cache."""
    ordered = policy.order(waiting, slots)
    for request in ordered:
        if (slot := policy.choose_slot(slots, request, tokens(request))) is not None:
            return Admission(request, slot)
    for request in ordered:
        if (slot := policy.victim(slots, request)) is not None:
            return Admission(request, slot, preempt=True)
    return None


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


def swaps_prompt(slot: Slot, tokens: list[int], params: RequestParams) -> bool:
    """Whether the chosen slot's prompt goes to the prompt cache and the best cached one comes back.

    llama-server's ``update_cache`` in ``get_available_slot``: yes when the slot would keep
    under half of what it holds (``f_keep < 0.5``), which covers a slot chosen as least
    recently used (its prompt is not the request's) and one named by ``id_slot`` that
    shares little with the prompt (a named slot "still goes through cache update logic";
    an empty one does not: its f_keep is 0/0); no when the prompt is similar and keeps at
    least half. (And no without ``cache_prompt``: the request would throw the restored
    prompt away.)
    """
    if not params.cache_prompt:
        return False
    lcp = common_prefix(slot.cache_tokens, tokens)
    if lcp / len(tokens) > SIMILARITY_THRESHOLD:  # chosen by similarity (Slot.similarity)
        return lcp / len(slot.cache_tokens) < KEEP_THRESHOLD
    return params.id_slot is None or bool(slot.cache_tokens)  # least recently used, or named and not similar


def held_prefix(slots: Sequence[Slot], tokens: list[int]) -> int:
    """The longest prefix of ``tokens`` that any of ``slots`` holds in its cells."""
    return max((common_prefix(slot.cache_tokens, tokens) for slot in slots), default=0)


def prefix_donor(slots: Sequence[Slot], slot: Slot, tokens: list[int]) -> tuple[Slot, int] | None:
    """(kv_share, llmkit's own) The other slot, busy or idle, that holds the longest prefix of ``tokens``, and how many
    of its cells ``slot`` takes, if that is more than ``slot`` keeps of its own. A token is always left to read: the
    first token is sampled from its logits."""
    n_own = common_prefix(slot.cache_tokens, tokens)
    held = [(min(common_prefix(other.cache_tokens, tokens), len(tokens) - 1), other) for other in slots if other is not slot]
    n, donor = max(held, key=lambda h: h[0], default=(0, slot))
    return (donor, n) if n > n_own else None


def waits_for_cells(slots: Sequence[Slot], tokens: list[int], min_shared: int) -> bool:
    """(kv_share) Whether a request for ``tokens`` waits for a prefix that a slot is reading now rather than read it
    too (SGLang's in-batch prefix caching): when that slot will hold ``min_shared`` or more of its tokens beyond what
    any slot holds already. It waits while that prefix is read, never longer than it would take to read it itself."""
    held = held_prefix(slots, tokens)
    reading = [s.job.context for s in slots if s.job is not None and not s.job.is_generating]
    return any(common_prefix(context, tokens) - held >= min_shared for context in reading)


@dataclass(frozen=True)
class Chunk:
    """What one job puts in a step's batch: ``tokens`` at positions ``pos``, ``pos + 1``, ... of its slot.

    ``i_logits``: where in the batch its last token is, if the step samples from it (-1: it does not,
    a prompt chunk that is not the prompt's end). A stream's chunk is the token it sampled last step,
    then its ``draft`` if it speculates: the step samples at each of those (``logit_rows``).
    """

    slot: Slot
    job: Job
    tokens: list[int]
    pos: int
    i_logits: int
    is_prompt: bool  # prompt tokens (else the token sampled last step, and its draft)

    @property
    def draft(self) -> list[int]:
        """The tokens guessed to follow a stream's sampled token (speculation; empty: none)."""
        return [] if self.is_prompt else self.tokens[1:]

    @property
    def logit_rows(self) -> range:
        """The batch rows the step samples from, in order: the last token's, and with a draft every one's."""
        return range(self.i_logits - len(self.draft), self.i_logits + 1) if self.i_logits >= 0 else range(0)


def build_batch(
    busy: Sequence[Running],
    capacity: int,
    budget: int = 0,
    drafts: Mapping[int, list[int]] | None = None,
    prompt_order: Callable[[Sequence[Running]], list[Running]] = LlamaServerPolicy().prompt_order,
) -> list[Chunk]:
    """Plan one ``llama_decode``: what each busy slot puts in the batch, in order. Changes nothing.

    Mirrors the batch building in llama-server's ``pre_decode`` (called by ``update_slots``):
    1. every generating slot adds the token it sampled last step (and its draft, if it speculates:
       ``drafts``, by slot id, from ``Engine.propose_drafts``);
    2. slots still reading their prompt add prompt tokens while the step has
       room (a long prompt continues next step: chunked prefill), in the policy's
       ``prompt_order`` (llama-server's: slot order; llmkit's default: oldest request first,
       so a request is never overtaken by a later one that landed in a lower slot);
    of a prompt, only the very last token asks for logits, since only there do we sample.

    ``budget`` caps the tokens of a step that carries running streams (0: the batch's ``capacity``,
    llama-server's ``n_batch``): stall-free batching (Sarathi-Serve; vLLM's chunked prefill), a burst
    of long prompts read a chunk per step while the streams keep getting a token every step. A step
    with no running stream keeps no one waiting: its prompts fill the batch.
    """
    plan, n_tokens = [], 0
    for slot, job in busy:
        if job.is_generating:
            draft = (drafts or {}).get(slot.id, [])
            n_tokens += 1 + len(draft)
            plan.append(Chunk(slot, job, [job.last_token, *draft], slot.n_past, n_tokens - 1, False))
    n_drafted = n_tokens - len(plan)  # a draft does not count against the budget: the stream's own tokens, checked in bulk
    limit = min(budget + n_drafted if budget else capacity, capacity) if plan else capacity
    for slot, job in prompt_order([(slot, job) for slot, job in busy if not job.is_generating]):
        room = limit - n_tokens
        if room <= 0:
            break
        tokens = job.prompt_left[:room]
        last = job.n_prompt_done + len(tokens) == len(job.context)
        n_tokens += len(tokens)
        plan.append(Chunk(slot, job, tokens, slot.n_past, n_tokens - 1 if last else -1, True))
    return plan
