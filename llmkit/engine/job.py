"""The run of one request on a slot: what generating it needs and what it has done so far (~ the per-task half of
llama-server's ``server_slot``: its ``task``, ``smpl``, ``n_decoded``, ``generated_text``, ``sampled``, its timings).

A ``Job`` starts when its request gets a slot (``Job.start``) and lives until the request ends. It knows
nothing of the slot it runs on: the slot points at its job (``Slot.job``), never the other way, and a step's
plan carries both (``scheduler.Chunk``). So a job can leave its slot and come back on another
(``Scheduler.preempt``, ``Job.resume``), with its sampler, detokenizer and stop strings as they were.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Integral

from llmkit.engine.request import End, Outcome, Piece, Request, TokenLogprob
from llmkit.llama import Context, Model
from llmkit.sampling import Sampler, SamplingParams
from llmkit.text import Detokenizer, StopMatcher
from llmkit.timings import Timings


@dataclass
class Job:
    request: Request
    sampler: Sampler
    detok: Detokenizer
    stops: StopMatcher
    context: list[int]  # what the slot must hold before the next token is sampled: the prompt (after a preemption: prompt + output)
    n_prompt_done: int = 0  # of ``context``, tokens in the KV cache (a step's commit adds its chunk)
    n_cached: int = 0  # prompt tokens reused from the KV cache when it started ...
    n_moved: int = 0  # ... of which moved into place (--cache-reuse)
    output: list[int] = field(default_factory=list)  # tokens generated so far
    last_token: int = -1  # sampled, not yet decoded
    truncated: bool = False  # its slot's context filled (a context shift dropped part of it)
    draft_window: int = 0  # the longest draft it may propose next (SpecParams.next_window)
    draft_n: int = 0  # speculation: tokens drafted ...
    draft_n_accepted: int = 0  # ... and accepted
    pending_tokens: list[int] = field(default_factory=list)  # sampled, text still held back (half a character, maybe a stop string)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0  # its first token (0: none yet)

    @classmethod
    def start(
        cls, model: Model, request: Request, n_keep: int, n_moved: int, *,
        sampler: Callable[[Model, SamplingParams], Sampler] = Sampler, stop_matcher: Callable[[tuple[str, ...]], StopMatcher] = StopMatcher,
    ) -> Job:  # fmt: skip
        """The job of ``request`` on a slot that holds its prompt's first ``n_keep`` tokens (``n_moved`` of them moved
        into place), with a sampler and a stop matcher of the kinds given (``EngineConfig``'s). Building the sampler may
        raise (a grammar): the engine then fails the request alone."""
        params, detok = request.params, Detokenizer(model.token_to_piece)
        made = sampler(model, params.sampling)
        return cls(request, made, detok, stop_matcher(params.stop), request.prompt, n_keep, n_cached=n_keep, n_moved=min(n_moved, n_keep))

    def sample(self, ctx: Context, row: int, n_vocab: int) -> int:
        """Its sampler's token for the logits of batch row ``row``, checked: anything but a token id of the model's
        vocabulary (a sampler of your own) raises here, failing this request alone, where llama.cpp would abort the
        process on it (``token_to_piece``) or fail the next step's whole batch (``llama_decode``)."""
        token = self.sampler.sample(ctx, row)
        if not (isinstance(token, Integral) and 0 <= token < n_vocab):
            made = type(self.sampler)
            raise ValueError(f"the sampler {made.__module__}.{made.__qualname__} returned {token!r}, not a token id of this "
                             f"model's vocabulary (0 to {n_vocab - 1})")  # fmt: skip
        return int(token)

    def resume(self, n_keep: int) -> None:
        """Go on after a preemption, on a slot holding the first ``n_keep`` tokens of what it had read and generated."""
        self.context = [*self.request.prompt, *self.output]
        self.n_prompt_done = n_keep

    @property
    def is_generating(self) -> bool:
        """Its context is in the KV cache: each step now decodes the token it sampled last."""
        return self.n_prompt_done == len(self.context)

    @property
    def prompt_left(self) -> list[int]:
        return self.context[self.n_prompt_done :]

    def read(self, n: int) -> None:
        """A step committed ``n`` more tokens of its context to the KV cache."""
        self.n_prompt_done += n

    def push(self, token: int, logprobs: TokenLogprob | None) -> str:
        """Take a sampled token; return the text now ready (whole characters, no part of a stop string)."""
        if not self.t_first:
            self.t_first = time.perf_counter()  # the prompt phase ends here
        self.output.append(token)
        self.last_token = token
        self.pending_tokens.append(token)
        if logprobs is not None:
            self.pending_logprobs.append(logprobs)
        return self.stops.push(self.detok.push(token))

    def flush(self) -> str:
        """The text still held back, at the end of the request."""
        return self.stops.push(self.detok.flush()) + self.stops.flush()

    def take(self, text: str) -> Piece:
        """``text`` with the tokens (and logprobs) it came from; they are no longer pending."""
        piece = Piece(text, self.pending_tokens, self.pending_logprobs)
        self.pending_tokens, self.pending_logprobs = [], []
        return piece

    def accept_draft(self, n_drafted: int, n_accepted: int) -> None:
        self.draft_n += n_drafted
        self.draft_n_accepted += n_accepted

    def timings(self, now: float | None = None) -> Timings:
        """Its timings so far (llama-server's ``timings``): the prompt phase ends at its first token."""
        now = time.perf_counter() if now is None else now
        t_first = self.t_first or now
        return Timings(
            cache_n=self.n_cached, n_cache_reuse=self.n_moved, prompt_n=len(self.request.prompt) - self.n_cached,
            prompt_ms=(t_first - self.t_start) * 1e3, predicted_n=len(self.output),
            predicted_ms=(now - self.t_first) * 1e3 if self.t_first else 0.0,
            draft_n=self.draft_n, draft_n_accepted=self.draft_n_accepted,
        )  # fmt: skip

    def outcome(self, end: End, id_slot: int | None, tokens_cached: int) -> Outcome:
        """How it ended, once: the request's ``Outcome`` (on slot ``id_slot``, holding ``tokens_cached`` tokens)."""
        now = time.perf_counter()
        word = self.stops.word if end is End.WORD else ""
        return Outcome(
            end, tuple(self.output), len(self.request.prompt), self.n_cached, self.timings(now), word, self.truncated,
            id_slot, tokens_cached, self.t_start, self.t_first, now,
        )  # fmt: skip
