"""Speculative decoding on the real model: drafts verified in the step's one batch, the answer unchanged.

(The drafters and the plan with drafts, without a model: test_drafts.py.)"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmkit.course import launch
from llmkit.engine import Engine, EngineConfig
from llmkit.engine.speculative import SpecParams, SpecType

from helpers import assert_error

# A completion that starts a copy of a source file's first 30 lines: the model copies about 150 characters
# (then its copy drifts), so the answer repeats text the prompt holds.
LINES = (Path(__file__).parents[1] / "llmkit" / "text.py").read_text().splitlines(keepends=True)
SOURCE = "".join(LINES[:30])
COPY = SOURCE + "\n\n" + "".join(LINES[:8])


@pytest.fixture(scope="module", params=[SpecType.NGRAM_SIMPLE, SpecType.NGRAM_MOD], ids=lambda t: t.value)
def engine(model, request):
    config = EngineConfig(n_parallel=2, n_ctx=4096, n_threads=1, speculative=SpecParams(request.param))
    with Engine(model, config) as e:
        yield e


def test_a_greedy_answer_is_the_same_with_and_without_speculation_and_comes_in_fewer_steps(engine):
    plain = engine.complete(COPY, max_tokens=64, temperature=0, cache_prompt=False, n_draft_max=0)
    plain.result()
    fast = engine.complete(COPY, max_tokens=64, temperature=0, cache_prompt=False)
    assert fast.result() == plain.result()
    assert plain.outcome.timings.draft_n == 0 and "draft_n" not in plain.outcome.timings.to_dict()
    t = fast.outcome.timings.to_dict()
    assert t["draft_n_accepted"] >= 16 and t["draft_n"] >= t["draft_n_accepted"]


def test_a_stop_string_inside_an_accepted_draft_ends_the_answer_exactly_there(engine):
    copied = engine.complete(COPY, max_tokens=24, temperature=0, n_draft_max=0).result()
    stop = copied[30:40]  # text the copy reaches in the middle of a draft
    plain = engine.complete(COPY, max_tokens=64, temperature=0, stop=[stop], n_draft_max=0)
    fast = engine.complete(COPY, max_tokens=64, temperature=0, stop=[stop])
    assert fast.result() == plain.result() and fast.outcome.stopping_word == plain.outcome.stopping_word == stop
    assert fast.outcome.timings.draft_n_accepted > 0


def test_a_constrained_answer_under_speculation_still_follows_its_grammar(engine):
    # the prompt repeats "b": the grammar wants "c" there, so drafts copied from the prompt get cut
    prompt = '{"a": 1, "b": 2}\n' * 12
    gbnf = r'root ::= "{\"a\": " [0-9] ", \"c\": " [0-9] "}\n" "{\"a\": " [0-9] ", \"b\": " [0-9] "}\n" "{\"a\": " [0-9] "}"'
    plain = engine.complete(prompt, max_tokens=48, temperature=0, grammar=gbnf, n_draft_max=0)
    fast = engine.complete(prompt, max_tokens=48, temperature=0, grammar=gbnf)
    assert re.fullmatch(r'\{"a": \d, "c": \d\}\n\{"a": \d, "b": \d\}\n\{"a": \d\}', fast.result())
    assert fast.result() == plain.result()
    assert fast.outcome.timings.draft_n > fast.outcome.timings.draft_n_accepted  # some draft was cut by the grammar


def test_a_rejected_draft_leaves_no_trace_in_the_kv_cache(model, monkeypatch):
    # size_n 2: drafts at the least repeat, many rejected; after each step the slot holds exactly
    # the prompt and the tokens generated before the last (sampled, not yet decoded)
    config = EngineConfig(n_parallel=1, n_ctx=1024, n_threads=1, speculative=SpecParams(SpecType.NGRAM_SIMPLE, 2, 8))
    with Engine(model, config, start=False) as engine:
        slot, real, seen = engine.slots[0], engine.ctx.decode, []

        def decode(batch):
            seen.append(engine.ctx.seq_pos_max(0) == len(slot.cache_tokens) - 1)
            real(batch)

        monkeypatch.setattr(engine.ctx, "decode", decode)
        r = engine.complete("one two three, one two three, one two four, one two", max_tokens=40, temperature=0, ignore_eos=True)
        rejected = 0
        while not r.done:
            step = engine.step()
            rejected += sum(s.n_draft - s.n_accepted for s in step.batch)
            if not r.done and slot.job is not None and slot.job.output:
                assert slot.cache_tokens == r.prompt + slot.job.output[:-1]
                assert engine.ctx.seq_pos_max(0) == len(slot.cache_tokens) - 1
        assert all(seen) and rejected > 0 and r.outcome.timings.draft_n > r.outcome.timings.draft_n_accepted


def test_a_slow_start_drafts_short_first_then_twice_the_run_each_draft_kept(model):
    config = EngineConfig(n_parallel=1, n_ctx=2048, n_threads=1, speculative=SpecParams(SpecType.NGRAM_SIMPLE, slow_start=4))
    with Engine(model, config) as engine:
        plain = engine.complete(COPY, max_tokens=64, temperature=0, n_draft_max=0)
        plain.result()
        engine.steps.clear()
        fast = engine.complete(COPY, max_tokens=64, temperature=0)
        assert fast.result() == plain.result()
    drafts = [(share.n_draft, share.n_accepted) for step in engine.steps for share in step.batch if share.n_draft]
    assert drafts[0][0] <= 4 and max(n for n, _ in drafts) > 4  # a short first draft, then longer ones
    for (_, kept), (n_next, _) in itertools.pairwise(drafts):
        assert n_next <= config.speculative.next_window(kept)


def test_two_streams_speculate_in_one_batch(model, engine):
    with Engine(model, engine.config, start=False) as by_hand:  # both admitted in the same step: they draft side by side
        a = by_hand.complete(COPY, max_tokens=48, temperature=0, cache_prompt=False)
        b = by_hand.complete(COPY, max_tokens=48, temperature=0, cache_prompt=False)
        while not (a.done and b.done):
            by_hand.step()
        assert a.result() == b.result()
        both = [s for s in by_hand.steps if len([share for share in s.batch if share.n_draft]) == 2]
        assert both, "no step verified both slots' drafts together"


def test_the_server_speculates_per_server_and_per_request_and_reports_it():
    flags = ("-np", "1", "-c", "2048", "-t", "1", "--temp", "0", "--metrics", "--spec-type", "ngram-simple", "--spec-slow-start", "8")
    with launch.serve("slots", *flags) as server, httpx.Client(base_url=server.url, timeout=300) as http:
        body = {"prompt": COPY, "n_predict": 32, "cache_prompt": False}
        fast = http.post("/completion", json=body).json()
        plain = http.post("/completion", json=body | {"speculative.n_max": 0}).json()
        assert fast["content"] == plain["content"]
        assert fast["timings"]["draft_n_accepted"] > 0 and "draft_n" not in plain["timings"]
        assert http.get("/slots").json()[0]["speculative"] is True
        props = http.get("/props").json()["engine"]["speculative"]
        assert (props["type"], props["slow_start"]) == ("ngram-simple", 8)
        metrics = {s.name: s.value for f in text_string_to_metric_families(http.get("/metrics").text) for s in f.samples}
        assert metrics["llamacpp:spec_decode_num_accepted_tokens_total"] == fast["timings"]["draft_n_accepted"]
        assert_error(http.post("/completion", json=body | {"speculative.n_max": -1}), 400, "invalid_request_error", "speculative.n_max")
