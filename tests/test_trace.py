"""The multi-tenant trace and what a replay's records add up to: model-free (no server; the replay itself runs in
tests/test_fleet.py against a real fleet)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llmkit.course import trace
from llmkit.course.trace import Record


def test_a_seed_makes_one_trace_and_another_seed_another():
    assert trace.make_trace(3) == trace.make_trace(3)
    assert trace.make_trace(3) != trace.make_trace(4)


def test_conversations_start_as_a_poisson_process_and_think_between_turns():
    t = trace.make_trace(seed=1, conversations=4000, rate=0.5, think=2.0, turns=3)
    starts = np.array([c.start for c in t.conversations])
    gaps = np.diff(np.concatenate([[0.0], starts]))
    assert (gaps > 0).all()
    # exponential inter-arrival times: mean 1/rate and a standard deviation equal to it (4000 samples: within 5 %)
    assert gaps.mean() == pytest.approx(2.0, rel=0.05) and gaps.std() == pytest.approx(2.0, rel=0.05)
    thinks = np.array([x for c in t.conversations for x in c.thinks])
    assert len(thinks) == 4000 * 2 and thinks.mean() == pytest.approx(2.0, rel=0.05)
    counts = np.bincount([c.tenant for c in t.conversations])
    assert len(counts) == 4 and counts.min() > 900  # tenants drawn evenly


def test_each_turn_resends_the_conversation_with_the_answer_then_asks_the_next_question():
    t = trace.make_trace(seed=2, turns=4)
    c = t.conversations[0]
    answers = ["first answer", "second answer", "third answer"]
    previous = t.messages(c, [])
    assert previous[-1] == {"role": "user", "content": c.questions[0]}
    for k in range(1, 4):
        now = t.messages(c, answers[:k])
        assert now[: len(previous)] == previous, "a turn starts with the whole previous request"
        assert now[len(previous) :] == [{"role": "assistant", "content": answers[k - 1]}, {"role": "user", "content": c.questions[k]}]
        previous = now


def test_a_tenant_s_conversations_share_its_long_prefix_and_tenants_differ():
    t = trace.make_trace(seed=0, tenants=3, conversations=30, system_words=150, shots=3)
    prefixes = [tenant.prefix() for tenant in t.tenants]
    assert len({str(p) for p in prefixes}) == 3
    for p in prefixes:
        assert p[0]["role"] == "system" and len(p[0]["content"].split()) >= 150
        assert [m["role"] for m in p[1:]] == ["user", "assistant"] * 3  # the few-shot examples
    for c in t.conversations:
        first = t.messages(c, [])
        assert first[: len(prefixes[c.tenant])] == prefixes[c.tenant]


def test_a_fresh_trace_is_the_same_trace_whose_prompts_share_no_prefix_with_the_old_one():
    t = trace.make_trace(seed=0, tenants=3, conversations=6)
    again = t.fresh("run 2")
    assert again.conversations == t.conversations and t.fresh("run 2") == again  # seeded: one tag, one trace
    for old, new in zip(t.tenants, again.tenants, strict=True):
        assert new.shots == old.shots and new.system.endswith(old.system) and new.system.startswith("[run 2] ")
        assert new.system[:16] != old.system[:16]  # a cache keyed by the first block of tokens holds nothing of it


def record(replica: str | None, prompt: int, cached: int, out: int, ttft: float, sent: float, seconds: float, error: str | None = None):
    return Record(0, 0, 0, sent, prompt, cached, out, ttft, seconds, replica, error)


def test_the_summary_counts_answered_requests_and_reports_cache_hits_ttft_percentiles_and_throughput():
    records = [
        record("0", 400, 0, 20, 2.0, sent=0.0, seconds=3.0),
        record("0", 450, 400, 20, 0.1, sent=1.0, seconds=1.0),
        record("1", 400, 300, 10, 0.5, sent=2.0, seconds=8.0),  # the last answer ends at 10 s
        record("1", 500, 0, 0, math.nan, sent=3.0, seconds=math.nan, error="RemoteProtocolError: peer closed"),
    ]
    s = trace.summarize(records)
    assert (s.requests, s.errors) == (4, 1)
    assert (s.prompt_tokens, s.cached_tokens, s.output_tokens) == (1250, 700, 50)
    assert s.cache_hit == pytest.approx(700 / 1250)
    assert s.wall == pytest.approx(10.0) and s.tokens_per_s == pytest.approx(5.0)
    assert s.ttft_p50 == pytest.approx(0.5) and s.ttft_p99 == pytest.approx(np.percentile([2.0, 0.1, 0.5], 99))
    assert s.per_replica == {"0": (2, 850), "1": (1, 400)}
    assert "cache hit  56.0%" in s.line() and "(1 failed)" in s.line()


def test_usage_comes_from_openai_usage_else_from_llama_server_timings():
    final = {"timings": {"prompt_n": 12, "cache_n": 100}}
    assert trace.usage_of(final, None) == (112, 100)
    usage = {"prompt_tokens": 112, "prompt_tokens_details": {"cached_tokens": 96}}
    assert trace.usage_of(final, usage) == (112, 96)
    assert trace.usage_of(None, {"prompt_tokens": 7}) == (7, 0)
