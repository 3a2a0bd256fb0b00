"""Disaggregated prefill and decode: one engine reads the prompt and samples the first token, another goes on from its
KV cells (``RequestParams.hand_off``, ``Engine.submit(..., kv=)``), and the text is the one engine's greedy text."""

from __future__ import annotations

import pytest

from llmkit.engine import Engine, EngineConfig, RequestParams

MESSAGES = [{"role": "user", "content": "Write three sentences about the harbour at dawn."}]


def config(**kw) -> EngineConfig:
    return EngineConfig(n_ctx=2048, n_threads=1, **kw)


@pytest.fixture(scope="module")
def greedy(model) -> str:
    with Engine(model, config()) as alone:
        return alone.chat(MESSAGES, max_tokens=40, temperature=0).result()


def handed_over(model, prefill: EngineConfig, decode: EngineConfig, **params) -> tuple[str, object]:
    prompt = model.tokenize_chat(MESSAGES)
    with Engine(model, prefill) as first, Engine(model, decode) as second:
        request = first.submit(prompt, RequestParams.of(max_tokens=1, temperature=0, hand_off=True))
        request.result()
        kv = request.outcome.kv
        assert kv is not None and list(kv.tokens) == prompt and len(kv.output) == 1
        going_on = second.submit(prompt, RequestParams.of(max_tokens=40, temperature=0, **params), kv=kv)
        return going_on.result(), going_on.outcome


def test_the_decode_engine_goes_on_from_the_prefill_engines_cells_with_the_same_greedy_text(model, greedy):
    text, outcome = handed_over(model, config(), config())
    assert text == greedy
    assert outcome.timings.prompt_n == 0 and outcome.n_cached == len(model.tokenize_chat(MESSAGES))  # it read no prompt token


def test_cells_of_another_kv_layout_are_refused_and_the_prompt_is_read_instead(model, greedy):
    text, outcome = handed_over(model, config(n_parallel=2), config(n_parallel=1))  # two KV streams, then one
    assert text == greedy and outcome.timings.prompt_n == len(model.tokenize_chat(MESSAGES))


def test_a_state_of_another_prompt_is_an_error(model):
    prompt = model.tokenize_chat(MESSAGES)
    with Engine(model, config(), start=False) as engine:
        first = engine.submit(prompt, RequestParams.of(max_tokens=1, temperature=0, hand_off=True))
        while not first.done:
            engine.step()
        assert first.outcome is not None and first.outcome.kv is not None
        with pytest.raises(ValueError, match="not this prompt"):
            engine.submit(prompt[:-1], RequestParams(), kv=first.outcome.kv)
