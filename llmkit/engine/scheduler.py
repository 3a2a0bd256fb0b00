"""The decisions the engine makes: which slot a request gets (and whether its prompt goes through the
prompt cache), and what goes in each step's batch.

They are pure functions over the slots: they change nothing, so they can be read (and tested) on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmkit.engine.job import Job
from llmkit.engine.request import Request, Status
from llmkit.engine.slot import Slot, common_prefix

SIMILARITY_THRESHOLD = 0.1  # llama-server's --slot-prompt-similarity default
KEEP_THRESHOLD = 0.5  # get_available_slot: a slot about to lose over half of what it holds goes to the prompt cache first


def choose_slot(slots: list[Slot], request: Request) -> Slot | None:
    """Pick an idle slot for ``request``, or None if it must wait.

    Mirrors llama-server's ``get_available_slot`` (server-context.cpp):
    the slot named by ``id_slot`` if any; else the idle slot whose cache
    shares the longest prefix with the prompt, if that covers more than 10 %
    of it; else the least recently used idle slot.
    """
    if request.params.id_slot is not None:
        slot = slots[request.params.id_slot]
        return slot if slot.is_idle else None
    idle = [s for s in slots if s.is_idle]
    if not idle:
        return None
    if request.params.cache_prompt:
        best = max(idle, key=lambda s: s.similarity(request.prompt))
        if best.similarity(request.prompt) > SIMILARITY_THRESHOLD:
            return best
    return min(idle, key=lambda s: s.t_last_used)


def swaps_prompt(slot: Slot, request: Request) -> bool:
    """Whether the chosen slot's prompt goes to the prompt cache and the best cached one comes back.

    llama-server's ``update_cache`` in ``get_available_slot``: yes when the slot would keep
    under half of what it holds (``f_keep < 0.5``), which covers a slot chosen as least
    recently used (its prompt is not the request's) and one named by ``id_slot`` that
    shares little with the prompt (a named slot "still goes through cache update logic";
    an empty one does not: its f_keep is 0/0); no when the prompt is similar and keeps at
    least half. (And no without ``cache_prompt``: the request would throw the restored
    prompt away.)
    """
    if not request.params.cache_prompt:
        return False
    lcp = common_prefix(slot.cache_tokens, request.prompt)
    if lcp / len(request.prompt) > SIMILARITY_THRESHOLD:  # chosen by similarity (Slot.similarity)
        return lcp / len(slot.cache_tokens) < KEEP_THRESHOLD
    return request.params.id_slot is None or bool(slot.cache_tokens)  # least recently used, or named and not similar


@dataclass(frozen=True)
class Chunk:
    """What one job puts in a step's batch: ``tokens`` at positions ``pos``, ``pos + 1``, ... of its slot.

    ``i_logits``: where in the batch its last token is, if the step samples from it (-1: it does not,
    a prompt chunk that is not the prompt's end). A stream's chunk is the token it sampled last step,
    then its ``draft`` if it speculates: the step samples at each of those (``logit_rows``).
    """

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


def build_batch(slots: list[Slot], capacity: int, budget: int = 0) -> list[Chunk]:
    """Plan one ``llama_decode``: what each busy slot puts in the batch, in order. Changes nothing.

    Mirrors the batch building in llama-server's ``pre_decode`` (called by ``update_slots``):
    1. every generating slot adds the token it sampled last step (and its draft, if it speculates:
       ``Engine.propose_drafts``);
    2. slots still reading their prompt add prompt tokens while the step has
       room (a long prompt continues next step: chunked prefill); llmkit takes
       the oldest request first, where llama-server goes in slot order, so a
       request is never overtaken by a later one that landed in a lower slot;
    of a prompt, only the very last token asks for logits, since only there do we sample.

    ``budget`` caps the tokens of a step that carries running streams (0: the batch's
    ``capacity``, llama-server's ``n_batch``). A small budget is stall-free batching
    (Sarathi-Serve; vLLM's chunked prefill): a burst of long prompts is read a chunk per
    step while the running streams keep getting a token every step, instead of waiting
    for one huge decode. A step with no running stream has no one to keep waiting: its
    prompts fill the batch, so a request alone gets its first token as soon as without it.
    A draft does not count against the budget: it is a stream's own tokens, checked in bulk.
    """
    jobs = [slot.job for slot in slots if slot.job is not None]
    plan, n_tokens = [], 0
    for job in (job for job in jobs if job.is_generating):
        n_tokens += 1 + len(job.draft)
        plan.append(Chunk(job, [job.last_token, *job.draft], job.slot.n_past, n_tokens - 1, False))
    n_drafted = n_tokens - len(plan)  # drafts do not count against the budget: they are the streams' own tokens
    limit = min(budget + n_drafted if budget else capacity, capacity) if plan else capacity
    for job in sorted((job for job in jobs if job.request.status is Status.PROMPT), key=lambda job: job.request.id):
        room = limit - n_tokens
        if room <= 0:
            break
        tokens = job.prompt_left[:room]
        last = job.n_prompt_done + len(tokens) == len(job.request.prompt)
        n_tokens += len(tokens)
        plan.append(Chunk(job, tokens, job.slot.n_past, n_tokens - 1 if last else -1, True))
    return plan
