"""The sampler chain that picks the next token, with llama-server's defaults (~ common/sampling.cpp).

- ``SamplingParams`` per-request sampling settings (~ ``common_params_sampling``)
- ``Sampler``        a llama.cpp sampler chain built from them, with the request's grammar beside it (llama_sampler)

The grammar the chain is masked with is ``llmkit.grammar``'s (``Grammar``, ``GrammarSampler``, ``Trigger``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llama_cpp as lc
import numpy as np

from llmkit.grammar.sampler import Grammar, GrammarSampler, Trigger
from llmkit.llama import Context, Model


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, with llama-server's defaults (~ ``common_params_sampling``: ``ignore_eos`` is
    one of them there too, a -inf bias on the end tokens; how long to go and where to stop are the request's,
    ``llmkit.engine.RequestParams``)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int | str, float], ...] = ()  # (token or text, bias): added to the logits (a text: its tokens)
    grammar: str | Grammar | None = None  # GBNF text (root rule "root"), or a Grammar: parsed and checked once (grammar.compile)
    grammar_trigger: str | None = None  # lazy grammar: free text until this word is written, then the grammar


LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp: pick a random seed


class Sampler:
    """A llama.cpp sampler chain built from ``SamplingParams``.

    Order as llama-server's common_sampler: [grammar] -> penalties -> top_k ->
    top_p -> min_p -> temperature -> dist, or greedy when temperature <= 0.
    The chain owns its samplers: freeing the chain frees them all.

    The grammar sampler stays out of the chain, as in common_sampler: llama.cpp
    aborts the process when a grammar accepts a token it does not allow (which
    ``llama_sampler_sample`` does when the grammar leaves no token at all), so
    ``sample`` checks the token before the grammar accepts it. A ``Grammar`` is
    cloned (parsed and checked before the request was queued); GBNF text, or a Grammar
    parsed for another model, is parsed here.
    """

    live = 0  # chains not yet freed, across the process (tests count them to catch leaks)

    def __init__(self, model: Model, params: SamplingParams):
        self.handle = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        Sampler.live += 1
        self.grammar: GrammarSampler | None = None
        self.trigger: Trigger | None = None  # a lazy grammar's, until it fires
        try:
            grammar = params.grammar
            if isinstance(grammar, Grammar) and grammar.sampler.model is model:
                self.grammar = grammar.sampler.clone()
            elif grammar is not None:
                self.grammar = GrammarSampler(model, grammar.text if isinstance(grammar, Grammar) else grammar)
            if self.grammar is not None and params.grammar_trigger:
                self.trigger = Trigger(model, params.grammar_trigger)
            for sampler in self._stages(model, params):
                if not sampler:
                    raise ValueError("llama.cpp could not build a sampler stage")
                lc.llama_sampler_chain_add(self.handle, sampler)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _stages(model: Model, p: SamplingParams):
        # llama-server: the request's logit_bias, and with ignore_eos a -inf bias on every end-of-generation token
        def tokens(key: int | str) -> list[int]:
            return [key] if isinstance(key, int) else model.tokenize(key, add_special=False, parse_special=False)

        given = [(t, b) for key, b in p.logit_bias for t in tokens(key)]
        banned = [(t, float("-inf")) for t in (model.eog_tokens if p.ignore_eos else ())]
        bias = [lc.llama_logit_bias(t, b) for t, b in [*given, *banned] if 0 <= t < model.n_vocab]
        if bias:
            yield lc.llama_sampler_init_logit_bias(model.n_vocab, len(bias), (lc.llama_logit_bias * len(bias))(*bias))
        if p.repeat_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            yield lc.llama_sampler_init_penalties(  # this llama.h still takes n_vocab first
                model.n_vocab, p.repeat_last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty
            )
        if p.temperature <= 0:
            yield lc.llama_sampler_init_greedy()
            return
        if p.top_k > 0:
            yield lc.llama_sampler_init_top_k(p.top_k)
        yield lc.llama_sampler_init_top_p(p.top_p, 1)
        yield lc.llama_sampler_init_min_p(p.min_p, 1)
        yield lc.llama_sampler_init_temp(p.temperature)
        yield lc.llama_sampler_init_dist(LLAMA_DEFAULT_SEED if p.seed is None else p.seed & 0xFFFFFFFF)

    def sample(self, ctx: Context, i: int) -> int:
        """Pick a token from the logits of batch output ``i`` and accept it into the chain."""
        grammar = self.grammar
        if grammar is None:
            return lc.llama_sampler_sample(self.handle, ctx.handle, i)
        # common_sampler_sample: sample as if unconstrained and keep the token if the grammar
        # allows it (one token to check, not the whole vocabulary); else mask, sample again.
        logits = np.ctypeslib.as_array(ctx.logits(i))
        token = self._pick(grammar.candidates(logits))
        if (trigger := self.trigger) is not None:  # a lazy grammar: only the trigger word's end is checked
            if not trigger.allows(token):
                token = self._pick(grammar.candidates(logits, trigger.allowed()))
            trigger.accept(token)
            if trigger.fired:
                self.trigger = None  # the grammar applies from the next token
        else:
            if not grammar.allows(token):
                token = self._pick(grammar.masked(logits))
            grammar.accept(token)
        lc.llama_sampler_accept(self.handle, token)
        return token

    def _pick(self, cur: lc.llama_token_data_array) -> int:
        lc.llama_sampler_apply(self.handle, ctypes.byref(cur))
        if not 0 <= cur.selected < cur.size or cur.data[cur.selected].logit == float("-inf"):
            raise ValueError("no token is left to sample: the grammar and the sampling settings exclude them all")
        return int(cur.data[cur.selected].id)

    def close(self) -> None:
        if self.grammar:
            self.grammar.close()
            self.grammar = None
        if self.handle:
            lc.llama_sampler_free(self.handle)
            self.handle = None
            Sampler.live -= 1
