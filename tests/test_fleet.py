"""A fleet: slot servers behind the real router (vllm-router), through the official clients; a replica killed
mid-stream and restarted; the errors a fleet that cannot start gives; and a fleet of real llama-servers.

One fleet for the module: 2 slot-server replicas (greedy, one thread each) behind the router's ``round_robin``, so
that consecutive requests alternate between them and a retry goes to the other one. The test of the worker's render
routes runs a second router, ``cache_aware``, in front of the same two replicas (no model loaded twice). The kill
test runs last: it restarts a replica.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import openai
import pytest

from llmkit.course import fleet, launch, trace

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def slots_fleet():
    with fleet.start(2, "slots", "round_robin", flags=("--temp", "0", "-np", "2", "-c", "4096")) as f:
        yield f


def chat(url: str, messages: list[dict], **params) -> dict:
    body = {"model": "any", "messages": messages, "max_tokens": 8, **params}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


# --- the three APIs through the router ----------------------------------------------------------------------------


def test_the_router_serves_chat_whole_and_streamed_from_both_replicas(slots_fleet):
    client = openai.OpenAI(base_url=f"{slots_fleet.url}/v1", api_key="none")
    messages = [{"role": "user", "content": "Name a colour."}]
    served = set()
    for _ in range(2):
        whole = client.chat.completions.create(model="any", messages=messages, max_tokens=8)
        assert whole.choices[0].message.content
        served.add(slots_fleet.replica_of(whole.model))
        chunks = list(client.chat.completions.create(model="any", messages=messages, max_tokens=8, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
        served.add(slots_fleet.replica_of(chunks[0].model))
    assert served == {0, 1}, "round_robin alternates: both replicas answered"


def test_the_router_serves_responses_whole_and_streamed(slots_fleet):
    client = openai.OpenAI(base_url=f"{slots_fleet.url}/v1", api_key="none")
    whole = client.responses.create(model="any", input="Name a fruit.", max_output_tokens=8)
    assert whole.output_text and slots_fleet.replica_of(whole.model) in (0, 1)
    events = list(client.responses.create(model="any", input="Name a fruit.", max_output_tokens=8, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == events[-1].response.output_text
    assert slots_fleet.replica_of(events[-1].response.model) in (0, 1)


def test_the_router_serves_anthropic_messages_whole_and_streamed(slots_fleet):
    client = anthropic.Anthropic(base_url=slots_fleet.url, api_key="none")
    messages = [{"role": "user", "content": "Name a city."}]
    whole = client.messages.create(model="any", max_tokens=8, messages=messages)
    assert whole.content[0].text and slots_fleet.replica_of(whole.model) in (0, 1)
    with client.messages.stream(model="any", max_tokens=8, messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and text == final.content[0].text and slots_fleet.replica_of(final.model) in (0, 1)


# --- what the router asks of a worker: the prompt's tokens --------------------------------------------------------


def test_render_gives_the_token_ids_the_chat_and_responses_routes_prefill(slots_fleet):
    url = slots_fleet.replicas[0].url
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
    ids = httpx.post(f"{url}/v1/chat/completions/render", json={"model": "any", "messages": messages}).json()["token_ids"]
    assert all(isinstance(t, int) for t in ids)
    assert len(ids) == chat(url, messages)["usage"]["prompt_tokens"]
    body = {"model": "any", "instructions": "Be brief.", "input": "Name a river."}
    assert httpx.post(f"{url}/v1/responses/render", json=body).json()["token_ids"] == ids  # the same chat, so the same prompt


def test_cache_aware_follows_the_rendered_prefix_to_a_busy_replica(slots_fleet):
    """The replica X that served a tenant's first request is kept busy by a long stream of the same tenant; the
    tenant's next request still goes to X, where its prefix is. Without the worker's render routes the router knows
    no tokens and sends it to the least-loaded replica, the other one (vllm-router's cache_aware.rs). (Whether X then
    reads the prefix from its cache is the engine's business: here the stream holds the slot that has it.)"""
    with slots_fleet.routed("cache_aware") as routed:
        router = routed.router
        system = {"role": "system", "content": " ".join(trace.make_trace(seed=7).tenants[0].system.split()[:120])}
        first = chat(router.url, [system, {"role": "user", "content": "Which account?"}])
        busy = slots_fleet.replica_of(first)
        started, stream_replica = threading.Event(), []

        def long_stream() -> None:
            body = {"model": "any", "messages": [system, {"role": "user", "content": "List the rules."}], "stream": True}
            with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body | {"max_tokens": 120}, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and not started.is_set():
                        stream_replica.append(slots_fleet.replica_of(json.loads(line[6:])))
                        started.set()

        thread = threading.Thread(target=long_stream)
        thread.start()
        assert started.wait(120)
        second = chat(router.url, [system, {"role": "user", "content": "Which branch?"}])
        thread.join()
    assert stream_replica == [busy], "the stream of the same tenant went where its prefix was"
    assert slots_fleet.replica_of(second) == busy, "and so did the next request, though the other replica was idle"


def test_a_trace_dealt_to_two_routers_sends_each_its_own_conversations(slots_fleet):
    """Conversation i goes to router i mod 2, both at once; each router counts only its own (its /metrics)."""
    dealt = trace.make_trace(seed=2, tenants=1, conversations=3, turns=1, rate=20, system_words=20, shots=0)
    with slots_fleet.routed("round_robin") as a, slots_fleet.routed("round_robin") as b:
        records = fleet.run_dealt([a, b], dealt, max_tokens=2)
        counted = [sum(v for k, v in f.router_metrics("vllm_router_requests_total").items() if "chat/completions" in k) for f in (a, b)]
    assert sorted(r.conversation for r in records) == [0, 1, 2] and all(r.error is None and r.replica in ("0", "1") for r in records)
    assert counted == [2, 1], counted


def test_repeated_runs_rank_only_beyond_the_spread():
    low, high = fleet.Repeated((1.0, 2.0, 3.0)), fleet.Repeated((3.5, 4.0, 6.0))
    assert (high.median, high.spread, high.format(".1f")) == (4.0, 2.5, "4.0 (3.5-6.0)")
    assert high.above(low, spread=1.5) and not high.above(low, spread=2.0)  # the medians 2 apart: beyond a spread of 1.5, not of 2
    assert not fleet.Repeated((2.5, 9.0, 9.0)).above(low, spread=0.0)  # a run of each overlaps: no ranking, however far the medians
    assert not low.above(high, spread=0.0)


def test_rotated_starts_each_round_further_on():
    arms = ["a", "b", "c"]
    assert [fleet.rotated(arms, k) for k in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert fleet.rotated([], 2) == []


# --- a fleet that cannot start --------------------------------------------------------------------------------------


def test_a_taken_port_is_named_before_anything_starts():
    with socket.socket() as taken:
        taken.bind((launch.HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(launch.PortInUse, match=f"port {port} "), fleet.start(2, "slots", port=port):
            pass
        argv = [sys.executable, "-m", "llmkit", "fleet", "--port", str(port)]
        run = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 1 and f"port {port} on 127.0.0.1 is taken" in run.stderr


def test_a_replica_that_fails_to_start_is_named_with_its_log(tmp_path):
    missing = tmp_path / "missing.gguf"
    expected = r"replica 0 of 2 \(slots on port \d+\) failed to start"
    with pytest.raises(fleet.FleetError, match=expected) as failed, fleet.start(2, "slots", flags=("-m", str(missing))):
        pass
    assert f"model file not found: {missing}" in str(failed.value), "the replica's log tail says why"


# --- a replica fails under load ---------------------------------------------------------------------------------------


async def long_streams(f: fleet.Fleet, n: int, max_tokens: int, on_started) -> list[dict]:
    """``n`` streams of ``max_tokens`` (no early end), started 0.3 s apart; ``on_started`` once each sent 2 pieces. A
    stream's pieces count chunks with text (a token past the end of generation can have none), ``finish`` its reason."""
    counts, all_started = [0] * n, asyncio.Event()

    async def one(i: int, client: httpx.AsyncClient) -> dict:
        await asyncio.sleep(0.3 * i)
        messages = [{"role": "user", "content": f"Count from {i * 100} upward."}]
        body = {"model": "any", "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        out: dict = {"replica": None, "pieces": 0, "finish": None, "error": None}
        try:
            async with client.stream("POST", f"{f.url}/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        out["replica"] = f.replica_of(chunk)
                        choice = chunk["choices"][0] if chunk["choices"] else {"delta": {}}
                        out["pieces"] += bool(choice["delta"].get("content"))
                        out["finish"] = choice.get("finish_reason") or out["finish"]
                        counts[i] = out["pieces"]
                        if min(counts) >= 2:
                            all_started.set()
        except httpx.HTTPError as exc:
            out["error"] = type(exc).__name__
        return out

    async with httpx.AsyncClient(timeout=httpx.Timeout(60, connect=5)) as client:
        tasks = [asyncio.create_task(one(i, client)) for i in range(n)]
        await asyncio.wait_for(all_started.wait(), 120)
        await asyncio.to_thread(on_started)
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)  # none hangs


def test_a_rolling_restart_under_steady_load_fails_no_request(slots_fleet):
    """Each replica in turn gets SIGTERM while streams run through the router: it drains (it takes no new connection,
    so the router retries on the other one, and its running streams finish), starts again, and rejoins."""
    f = slots_fleet
    records, stopped = asyncio.run(fleet.steady_load(f, 3, lambda: (time.sleep(2), f.rolling_restart())[1]))  # load first
    failed = [r for r in records if r["status"] != 200 or r["error"] is not None or r["finish"] != "length"]
    assert not failed, failed
    assert len(records) >= 10 and {r["replica"] for r in records} == {0, 1}, records
    for i, t in enumerate(stopped):  # each replica had a stream running when it was told to stop, and finished it
        assert any(r["replica"] == i and r["t0"] < t < r["t1"] for r in records), (i, t, records)


def test_a_killed_replica_fails_only_its_in_flight_requests_and_rejoins_after_a_restart(slots_fleet):
    f, victim, after = slots_fleet, 1, []

    def kill_then_ask() -> None:
        f.kill(victim)
        after.extend(chat(f.url, [{"role": "user", "content": f"Name a number above {k}."}], max_tokens=4) for k in range(4))

    streams = asyncio.run(long_streams(f, 4, 300, kill_then_ask))  # long enough that none ends before the kill
    on_victim = [s for s in streams if s["replica"] == victim]
    on_other = [s for s in streams if s["replica"] == 1 - victim]
    assert len(on_victim) == len(on_other) == 2, streams
    assert all(s["error"] is not None and s["finish"] is None for s in on_victim), f"its in-flight streams broke off: {on_victim}"
    assert all(s["error"] is None and s["finish"] == "length" for s in on_other), f"the other replica's streams finished: {on_other}"
    assert [f.replica_of(a) for a in after] == [1 - victim] * 4, "the fleet kept answering (a retry goes to the survivor)"

    f.restart(victim)  # same port; the router's health check lets it back in (and its circuit, if it opened, after 10 s)
    deadline = time.monotonic() + 30
    while f.replica_of(chat(f.url, [{"role": "user", "content": "Hi"}], max_tokens=2)) != victim:
        assert time.monotonic() < deadline, "the restarted replica is routed to again"
        time.sleep(0.5)


# --- a fleet of the real llama-server ------------------------------------------------------------------------------


def test_a_fleet_of_llama_servers_routes_a_chat_to_each_replica_and_ctrl_c_stops_every_process():
    with pytest.raises(KeyboardInterrupt), fleet.start(2, "llama-server", "round_robin", flags=("-np", "1", "-c", "1024")) as f:
        answers = [chat(f.url, [{"role": "user", "content": "Name a colour."}]) for _ in range(2)]
        raise KeyboardInterrupt
    assert all(a["choices"][0]["message"]["content"] for a in answers)
    assert sorted(f.replica_of(a) for a in answers) == [0, 1]
    for process in (f.router, *f.replicas):
        assert not process.running()
        launch.check_free(process.port)  # no port left bound
