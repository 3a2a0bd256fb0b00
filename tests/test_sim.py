"""The fleet model (llmkit.course.sim): model-free and fast, but for one slow test of the calibration on the real model."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from llmkit.course.sim.capacity import replicas_for_slo
from llmkit.course.sim.check import Background, check_runs
from llmkit.course.sim.cost import CALIBRATION, SERVER_STEP, GpuLikeCost, Point, StepCost, fit, pairs
from llmkit.course.sim.router import BLOCK, HeldBlocks, RadixTree, block_keys
from llmkit.course.sim.run import LATENCY, Answers, answer_lengths, chat_tokens, simulate
from llmkit.course.trace import make_trace
from llmkit.engine import RequestParams

# A cost model of round numbers (not the shipped fit: the tests hold whatever a re-calibration gives)
COST = StepCost(base=0.004, per_prompt=0.002, per_generated=0.008, per_context=0.0002, state_per_token=1e-6)


def test_a_fit_recovers_the_costs_it_was_made_from_and_says_which_terms_matter():
    rng = random.Random(0)
    points = []
    for _ in range(200):
        n_prompt, n_generated, context = rng.choice([0, rng.randrange(1, 2048)]), rng.randrange(0, 5), rng.uniform(0, 500)
        seconds = COST(n_prompt, n_generated or (n_prompt == 0), context) * rng.uniform(0.97, 1.03)
        points.append(Point(n_prompt, n_generated or (n_prompt == 0), context, seconds))
    cost = fit(points)
    for term in ("base", "per_prompt", "per_generated", "per_context"):
        assert getattr(cost, term) == pytest.approx(getattr(COST, term), rel=0.15), term
    assert cost.error["median"] < 0.03
    assert cost.terms["per_prompt"] > 3 * cost.error["median"]  # without the prompt term the fit is far worse


def test_the_shipped_calibration_reproduces_its_own_points_within_its_stated_error():
    cost = StepCost.load(CALIBRATION)
    errors = abs(cost.relative_errors())
    assert len(cost.points) >= 50
    assert sorted(errors)[len(errors) // 2] == pytest.approx(cost.error["median"], rel=0.05, abs=1e-3)
    assert cost.error["median"] < 0.35  # noisy on a shared 2-core machine, but a fit
    assert cost.per_prompt > 0 and cost.per_generated > 0


def test_the_gpu_like_curve_is_flat_to_its_knee_then_linear():
    gpu = GpuLikeCost(flat=0.01, knee=256)
    assert gpu(0, 1, 0) == gpu(200, 56, 0) == 0.01
    assert gpu(512, 0, 0) == pytest.approx(0.02)
    assert pairs(3, 10) == 10 + 11 + 12 + 3


def test_the_simulation_is_deterministic_for_a_seed():
    trace = make_trace(seed=1, conversations=8)
    runs = [simulate(trace, 2, "power_of_two", cost=COST, seed=s).records for s in (0, 0, 1)]
    assert runs[0] == runs[1]
    assert [r.replica for r in runs[0]] != [r.replica for r in runs[2]]  # the seed draws power_of_two's pairs


def test_more_replicas_answer_sooner_at_the_same_load():
    trace = make_trace(seed=2, conversations=30, rate=2.0, think=0.5)
    p99 = [simulate(trace, n, "round_robin", cost=COST).summary.ttft_p99 for n in (1, 2, 4)]
    p50 = [simulate(trace, n, "round_robin", cost=COST).summary.ttft_p50 for n in (1, 2, 4)]
    assert p99[0] > p99[1] > p99[2] and p50[0] > p50[2]


def test_shared_cores_slow_replicas_that_step_at_once():
    trace = make_trace(seed=3, conversations=16, rate=1.0)
    alone, shared = (simulate(trace, 3, "round_robin", cost=COST, cores=c).summary for c in (None, 1))
    assert shared.ttft_p50 > 1.3 * alone.ttft_p50


def test_a_measured_share_of_a_core_slows_every_step_by_its_inverse():
    trace = make_trace(seed=3, conversations=6, turns=1, rate=0.05)  # far apart: no queue, each TTFT one prompt's steps
    alone, half = (simulate(trace, 1, "round_robin", cost=COST, cores=2, background=9, share=s, render=0).records for s in (1.0, 0.5))
    assert [r.ttft - LATENCY for r in half] == pytest.approx([2 * (r.ttft - LATENCY) for r in alone])
    assert [r.conversation for r in half] == [r.conversation for r in alone] == list(range(6))


def test_a_prefix_aware_router_waits_for_every_workers_render_first():
    trace = make_trace(seed=3, conversations=1, turns=1)
    ttft = {p: simulate(trace, 3, p, cost=COST, render=0.25).records[0].ttft for p in ("round_robin", "cache_aware", "kv_aware")}
    assert ttft["cache_aware"] == ttft["kv_aware"] == pytest.approx(ttft["round_robin"] + 0.25)
    on_two_cores = simulate(trace, 3, "cache_aware", cost=COST, cores=2, render=0.25).records[0].ttft
    assert on_two_cores == pytest.approx(ttft["round_robin"] + 0.25 * 3 / 2)  # three renders at once on two cores


def test_the_check_models_each_real_run_and_tells_the_spread_of_the_real_ones():
    trace = make_trace(seed=8, conversations=6, rate=1.0)
    runs = [simulate(trace, 2, "cache_aware", cost=COST.scaled(k)).records for k in (1.0, 2.0, 3.0)]  # three "real" runs
    rows = check_runs({(2, "cache_aware"): [(r, 0.0) for r in runs], (1, "cache_aware"): (runs[0], 0.0)}, trace, COST, None, 24)
    several, one = rows[2, "cache_aware"], rows[1, "cache_aware"]
    assert len(several.real) == len(several.sim) == 3 and len(one.real) == 1
    p50 = sorted(s.ttft_p50 for s in several.real)
    assert several.spread("ttft_p50") == pytest.approx(100 * (p50[2] - p50[0]) / p50[1])
    assert several.error("ttft_p50") == pytest.approx(100 * (several.median("ttft_p50", "sim") - p50[1]) / p50[1])
    as_a_server = simulate(trace, 2, "cache_aware", cost=COST.scaled(SERVER_STEP), answers=Answers(24, answer_lengths(runs[1])))
    assert several.sim[1] == as_a_server.summary  # each run modelled with its answers, the fit scaled as the slot server steps


def test_a_scaled_cost_scales_every_term_and_says_so():
    twice = COST.scaled(2)
    assert twice(10, 2, 3.0) == pytest.approx(2 * COST(10, 2, 3.0)) and twice.machine["scaled"] == 2


def test_the_background_sampler_measures_the_share_of_a_core_its_processes_got():
    import os
    import time

    busy = Background([os.getpid()])
    busy.start()
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.3:  # a busy thread of this process
        pass
    busy.done.set()
    assert 0 < busy.share <= 1 and busy.mean >= 0


def test_prefix_aware_policies_find_more_of_the_prompt_cached_than_round_robin():
    trace = make_trace(seed=4, tenants=6, conversations=40, rate=1.0)
    hit = {p: simulate(trace, 3, p, cost=COST).summary.cache_hit for p in ("round_robin", "cache_aware", "kv_aware")}
    assert hit["cache_aware"] > hit["round_robin"] + 0.05
    assert hit["kv_aware"] > hit["round_robin"] + 0.05


def test_a_turn_on_the_replica_of_the_last_one_reads_only_what_is_new():
    trace = make_trace(seed=5, conversations=1, turns=3)
    records = simulate(trace, 1, "round_robin", cost=COST, answers=Answers(max_tokens=8)).records
    conversation = trace.conversations[0]
    for turn in (1, 2):
        said = [" ".join(Answers(max_tokens=8).words(conversation.id, t)) for t in range(turn)]
        last = chat_tokens(trace.messages(conversation, said[:-1]))
        # the last prompt and the answer decoded after it (the last sampled token is never decoded) are in the cache
        assert records[turn].cached_tokens == len(last) + 8 - 1


def test_the_radix_tree_matches_each_replicas_longest_sent_prefix():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], 0)
    tree.insert([1, 2, 5], 1)
    tree.insert([1, 2, 3, 9], 1)
    assert tree.match([1, 2, 3, 4, 7]) == {0: 4, 1: 3}
    assert tree.match([1, 2, 5, 6]) == {0: 2, 1: 3}
    assert tree.match([8]) == {}


def test_kv_aware_sees_exactly_what_each_replica_holds():
    trace = make_trace(seed=6, tenants=3, conversations=20, rate=1.0)
    replicas = simulate(trace, 2, "kv_aware", cost=COST).fleet.replicas
    for replica in replicas:
        fresh = HeldBlocks()
        fresh.sync(replica.slots, replica.cache)
        assert replica.held is not None and replica.cache is not None
        assert +replica.held.device == +fresh.device and +replica.held.host == +fresh.host
        assert sum(fresh.host.values()) == sum(len(e.tokens) // BLOCK for e in replica.cache.entries) > 0
    assert block_keys(list(range(40)))[:2] == block_keys(list(range(32)))


def test_the_capacity_search_returns_the_fewest_replicas_that_meet_the_slo():
    trace = make_trace(seed=7, conversations=40, rate=4.0, think=0.5)
    found = replicas_for_slo(trace, "round_robin", slo=1.5, cost=COST)
    assert found.replicas > 1
    assert found.tried[found.replicas].ttft_p99 < 1.5
    assert found.tried[found.replicas - 1].ttft_p99 >= 1.5 or found.replicas - 1 not in found.tried
    later = replicas_for_slo(trace, "round_robin", slo=1.5, cost=COST, start=2)  # the same answer, without the smallest fleet
    assert later.replicas == found.replicas and 1 not in later.tried


@pytest.mark.slow
def test_calibration_measures_the_real_engine():
    from llmkit.course.sim.cost import measure

    cost = measure(scale=0.05)
    assert len(cost.points) > 30
    assert cost(128, 0, 10) > cost(0, 1, 0) > 0
    assert cost.state_per_token > 0


@pytest.mark.slow
@pytest.mark.parametrize(("step_tokens", "share"), [(0, False), (32, False), (32, True)])
def test_the_simulation_admits_and_plans_as_the_engine_on_the_same_requests(model, step_tokens, share):
    """The model's replica is the engine's scheduler: the same slots, chunks and cache hits, step for step, on requests
    that share prefixes, outnumber the slots and read prompts longer than a batch (one token each, no model text);
    with kv_share, the same cells taken from other slots and resident prefixes."""
    import simpy

    from llmkit.course.sim.replica import Cores, Replica, ReplicaConfig, SimRequest
    from llmkit.engine import Engine

    rng = random.Random(step_tokens)
    stems = [[rng.randrange(300, 9000) for _ in range(90)] for _ in range(3)]
    trace = [(stems[k % 3] + [rng.randrange(300, 9000) for _ in range(rng.randrange(5, 60))], rng.randrange(2, 9)) for k in range(7)]
    config = ReplicaConfig(n_slots=2, n_ctx=1024, n_batch=64, step_tokens=step_tokens, cache_ram_mib=64, kv_share=share)
    env = simpy.Environment()
    replica = Replica(env, 0, COST, Cores(), config)
    runs = [SimRequest(k, prompt, list(range(n))) for k, (prompt, n) in enumerate(trace)]
    for run in runs:
        replica.submit(run)
    env.run()
    with Engine(model, replace(config.engine_config(), n_threads=1), start=False) as engine:
        requests = [engine.submit(prompt, RequestParams.of(max_tokens=n, ignore_eos=True)) for prompt, n in trace]
        while not all(r.done for r in requests):
            engine.step()
        batches = [tuple(share[:4] for share in step.batch) for step in engine.steps]
    assert [tuple(share[:4] for share in batch) for batch in replica.batches] == batches
    assert [run.n_cached for run in runs] == [r.outcome.n_cached for r in requests]
    assert any(run.n_cached for run in runs) and len(batches) > 15  # the trace reused prefixes, over many steps
    assert (replica.scheduler.counters.prompt_tokens_shared_total > 0) is share
