"""The work running on a slot: one request and what generating it needs (~ the per-task half of llama-server's
``server_slot``: its ``task``, ``smpl``, ``n_decoded``, ``generated_text``, ``sampled``).

A ``Job`` exists only while its request holds a slot (``Slot.start`` makes it, ``Slot.release`` drops it), so
nothing in it is ever None: the slot's ``job`` is, and the engine narrows it once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmkit.engine.request import Piece, Request, Status, TokenLogprob
from llmkit.llama import Sampler
from llmkit.text import Detokenizer, StopMatcher

if TYPE_CHECKING:
    from llmkit.engine.slot import Slot


@dataclass
class Job:
    request: Request
    slot: Slot  # where it runs
    sampler: Sampler
    detok: Detokenizer
    stops: StopMatcher
    n_prompt_done: int  # prompt tokens in the KV cache (after a step commits them)
    last_token: int = -1  # sampled, not yet decoded
    draft: list[int] = field(default_factory=list)  # guessed to follow last_token, for this step to verify (speculation)
    draft_window: int = 0  # the longest draft it may propose next (SpecParams.next_window)
    pending_tokens: list[int] = field(default_factory=list)  # sampled, text still held back (half a character, maybe a stop string)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def is_generating(self) -> bool:
        return self.request.status is Status.GENERATING

    @property
    def prompt_left(self) -> list[int]:
        return self.request.prompt[self.n_prompt_done :]

    def push(self, token: int, logprobs: TokenLogprob | None) -> str:
        """Take a sampled token; return the text now ready (whole characters, no part of a stop string)."""
        self.request.output.append(token)
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
