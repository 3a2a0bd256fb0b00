"""What the steps did: each one's ``StepRecord`` (``Engine.steps`` keeps the last ones) and the engine-wide ``Counters``
(what ``/metrics`` exposes, llama-server's names)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import NamedTuple

from llmkit.timings import Timings


@dataclass
class Counters:
    """Engine-wide totals since start (what ``/metrics`` exposes, llama-server's names)."""

    prompt_tokens_total: int = 0  # prompt tokens evaluated (cache hits not included)
    prompt_seconds_total: float = 0.0
    prompt_tokens_cached_total: int = 0
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    n_decode_total: int = 0
    n_tokens_max: int = 0  # the longest sequence a slot held after a decode (prompt + generation)
    n_busy_slots_total: int = 0  # summed over decodes: / n_decode_total = busy slots per decode
    n_tokens_decoded_total: int = 0  # batch sizes summed over decodes
    batch_prompt_tokens_total: int = 0  # of which prompt tokens ...
    batch_generated_tokens_total: int = 0  # ... and streams' tokens (the one sampled the step before, and drafts)
    spec_decode_num_draft_tokens_total: int = 0  # speculation: tokens drafted (llama-server's names) ...
    spec_decode_num_accepted_tokens_total: int = 0  # ... of which accepted ...
    spec_decode_num_drafts_total: int = 0  # ... over this many verifications
    decode_seconds_total: float = 0.0  # time inside llama_decode
    step_seconds_total: float = 0.0  # whole steps: decode + Python bookkeeping
    requests_finished_total: int = 0
    requests_failed_total: int = 0
    requests_preempted_total: int = 0  # llmkit's own: jobs that left their slot for a request that goes first
    prompt_tokens_shared_total: int = 0  # llmkit's own (kv_share): prompt tokens whose cells a slot took from another

    def snapshot(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def copy(self) -> Counters:
        return replace(self)

    def record_finish(self, t: Timings, *, ok: bool) -> None:
        """A request left its slot: add its timings (llama-server: metrics_on_prediction)."""
        self.prompt_tokens_total += t.prompt_n
        self.prompt_seconds_total += t.prompt_ms / 1e3
        self.prompt_tokens_cached_total += t.cache_n
        self.tokens_predicted_total += t.predicted_n
        self.tokens_predicted_seconds_total += t.predicted_ms / 1e3
        self.requests_finished_total += ok

    def record_failure(self) -> None:
        self.requests_failed_total += 1

    def record_preemption(self) -> None:
        self.requests_preempted_total += 1

    def record_share(self, n_tokens: int) -> None:
        self.prompt_tokens_shared_total += n_tokens

    def record_draft(self, n_drafted: int, n_accepted: int) -> None:
        self.spec_decode_num_draft_tokens_total += n_drafted
        self.spec_decode_num_accepted_tokens_total += n_accepted
        self.spec_decode_num_drafts_total += 1

    def record_step(self, step: StepRecord, n_tokens_longest: int = 0) -> None:
        """One decode; ``n_tokens_longest``: the most tokens a slot of it holds now (llama-server's n_tokens_max)."""
        self.n_decode_total += 1
        self.n_tokens_max = max(self.n_tokens_max, n_tokens_longest)
        self.n_busy_slots_total += step.n_slots
        self.n_tokens_decoded_total += step.n_prompt + step.n_generated
        self.batch_prompt_tokens_total += step.n_prompt
        self.batch_generated_tokens_total += step.n_generated
        self.decode_seconds_total += step.decode_seconds
        self.step_seconds_total += step.seconds


class Share(NamedTuple):
    """One slot's part of a step's batch."""

    slot: int
    n_tokens: int
    is_prompt: bool  # prompt tokens (else the token sampled the step before, and its draft)
    sampled: bool  # the step sampled a token for it
    n_draft: int = 0  # speculation: of n_tokens, tokens guessed ...
    n_accepted: int = 0  # ... and of those, the ones the model sampled too (kept in the KV cache)


@dataclass(frozen=True)
class StepRecord:
    """One engine step: when, how long, and what its batch held (``Engine.steps`` keeps the last ones)."""

    t: float  # time.perf_counter() at the start of the step
    seconds: float  # the whole step
    decode_seconds: float  # of which inside llama_decode
    n_prompt: int  # prompt tokens in the batch
    n_generated: int  # tokens of generating slots in the batch (one each, plus drafts)
    n_slots: int  # slots with a token in the batch
    batch: tuple[Share, ...] = ()  # who put what in it, in batch order
