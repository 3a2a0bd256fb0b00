"""A fleet in the model: the trace's users, the router's policy, the replicas; ``simulate`` runs it and returns what a
real replay would have measured (``llmkit.course.trace.Record``s, so ``trace.summarize`` reads both alike).

    result = simulate(make_trace(seed=0), replicas=2, policy="cache_aware", cores=2)
    result.summary.line()        # cache hit, TTFT p50/p99, tokens/s, load per replica: as a real replay's

Each conversation is a simpy process, as the replay's ``converse``: wait for its start, send a turn (the tenant's
prefix, the turns so far with their answers, the new question), wait for the whole answer, think, send the next.
The prompt is the trace's messages in SmolLM2's chat template (ChatML) over ``text_tokens``, a stand-in tokenizer: one
id per word, digit and punctuation mark (SmolLM2's own gives 1-3 % more tokens on the trace's words: the model needs no
model). An answer is ``max_tokens`` tokens, or the lengths a real replay measured (``answer_lengths``), its words
drawn from the trace's vocabulary, the same for a seed; it goes back into the next turn as the real answer does.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import simpy

from llmkit.course.sim.cost import Cost, StepCost
from llmkit.course.sim.replica import Cores, Replica, ReplicaConfig, SimRequest
from llmkit.course.sim.router import POLICIES, KvAware, Policy, Routed
from llmkit.course.trace import WORDS, Conversation, Record, Summary, Trace, summarize

PIECES = re.compile(r"\d|[^\W\d]+|[^\w\s]|\s(?=\d)")  # a word, a digit (with the space before it), a mark
IM_START, IM_END, NEWLINE, EOS = 1, 2, 198, 2  # ChatML's markers (SmolLM2's ids); <|im_end|> ends an answer
LATENCY = 0.005  # seconds from the client to the replica's queue: HTTP and the router's hop
RENDER = 0.0033  # CPU seconds a worker spends rendering a chat for a prefix-aware router (scripts/sim_bias.py measured 3.2-3.7 ms)


def token_id(piece: str) -> int:
    return zlib.crc32(piece.encode()) + 1000


def text_tokens(text: str) -> list[int]:
    return [token_id(piece) for piece in PIECES.findall(text)]


def chat_tokens(messages: Sequence[dict]) -> list[int]:
    """The messages in ChatML (``<|im_start|>role\\n...<|im_end|>\\n``), then the assistant's turn opened."""
    ids: list[int] = []
    for message in messages:
        ids += [IM_START, token_id(message["role"]), NEWLINE, *text_tokens(message["content"]), IM_END, NEWLINE]
    return [*ids, IM_START, token_id("assistant"), NEWLINE]


def answer_lengths(records: Sequence[Record]) -> dict[tuple[int, int], int]:
    """(conversation, turn) -> tokens answered, from a real replay: the simulation then writes answers that long."""
    return {(r.conversation, r.turn): r.output_tokens for r in records if r.error is None}


@dataclass
class Answers:
    """What each turn's answer is: its words (seeded), and whether it ends on the end token before ``max_tokens``."""

    max_tokens: int = 24
    lengths: Mapping[tuple[int, int], int] | None = None
    seed: int = 0

    def words(self, conversation: int, turn: int) -> list[str]:
        n = self.max_tokens if self.lengths is None else self.lengths.get((conversation, turn), self.max_tokens)
        return random.Random(hash((self.seed, conversation, turn))).choices(WORDS, k=n)

    def tokens(self, words: list[str]) -> list[int]:
        """The tokens the replica samples: the words', and the end token if the answer stops short of ``max_tokens``."""
        return [token_id(w) for w in words] + ([EOS] if len(words) < self.max_tokens else [])


@dataclass
class SimFleet:
    """The router and the replicas, on one simpy clock."""

    env: simpy.Environment
    policy: Policy
    replicas: list[Replica]
    latency: float = LATENCY
    render: float = RENDER

    @classmethod
    def build(cls, env: simpy.Environment, n: int, policy: str, cost: Cost, cores: Cores, config: ReplicaConfig, seed: int) -> SimFleet:
        router = POLICIES[policy](n, seed)
        held = router.held if isinstance(router, KvAware) else [None] * n
        return cls(env, router, [Replica(env, i, cost, cores, config, held[i]) for i in range(n)])

    def ask(self, routed: Routed, request: SimRequest) -> Generator[simpy.Event, Any, int]:
        """Route a request and wait for its whole answer (a simpy process's step); returns the replica's index."""
        done = self.env.event()
        if self.policy.renders:
            yield from self.fan_out()
        index = self.policy.route(routed)
        request.on_first = lambda r: self.policy.first_token(index, routed)
        request.on_done = lambda r: done.succeed()
        yield self.env.timeout(self.latency)
        self.replicas[index].submit(request)
        yield done
        self.policy.finished(index, routed)
        return index

    def fan_out(self) -> Generator[simpy.Event, Any, None]:
        """A prefix-aware router first asks every worker for the prompt's tokens (``/render``) and waits for the slowest:
        one render's CPU on each replica at once, on the cores they share (on their own machines, one render's time)."""
        cores = self.replicas[0].cores
        cores.busy += len(self.replicas)
        yield self.env.timeout(self.render * cores.slowdown())
        cores.busy -= len(self.replicas)


def converse(
    fleet: SimFleet, trace: Trace, conversation: Conversation, answers: Answers, records: list[Record]
) -> Generator[simpy.Event, Any, None]:
    """One user: each question after the last answer and a think time (the replay's ``converse``)."""
    env = fleet.env
    yield env.timeout(conversation.start)
    said: list[str] = []
    for turn in range(len(conversation.questions)):
        prompt = chat_tokens(trace.messages(conversation, said))
        words = answers.words(conversation.id, turn)
        request = SimRequest(len(records), prompt, answers.tokens(words))
        record = Record(conversation.id, conversation.tenant, turn, env.now, prompt_tokens=len(prompt), output_tokens=len(words))
        records.append(record)
        index = yield from fleet.ask(Routed(f"conversation-{conversation.id}", prompt), request)
        record.ttft, record.seconds = request.t_first - record.sent, request.t_end - record.sent
        record.cached_tokens, record.replica = request.n_cached, str(index)
        said.append(" ".join(words))
        if turn < len(conversation.thinks):
            yield env.timeout(conversation.thinks[turn])


@dataclass
class SimResult:
    records: list[Record]
    summary: Summary
    fleet: SimFleet  # as the run left it: each replica's slots, prompt cache, steps; the router's state


def simulate(
    trace: Trace,
    replicas: int = 2,
    policy: str = "cache_aware",
    *,
    cost: Cost | None = None,
    cores: float | None = None,
    background: float = 0.0,
    share: float | None = None,
    config: ReplicaConfig | None = None,
    answers: Answers | None = None,
    latency: float = LATENCY,
    render: float = RENDER,
    seed: int = 0,
) -> SimResult:
    """Replay ``trace`` through a modelled fleet: ``replicas`` slot servers (``config``: ``llmkit serve slots``'s
    defaults) behind ``policy``, each step costing what ``cost`` says (the shipped calibration by default), all on
    ``cores`` cores (None: each replica on its own) beside ``background`` busy threads of other programs (``Cores``).
    Deterministic for a seed."""
    env = simpy.Environment()
    fleet = SimFleet.build(
        env, replicas, policy, cost or StepCost.load(), Cores(cores, background, share=share), config or ReplicaConfig(), seed
    )
    fleet.latency, fleet.render = latency, render
    records: list[Record] = []
    users = [env.process(converse(fleet, trace, c, answers or Answers(seed=seed), records)) for c in trace.conversations]
    env.run(until=env.all_of(users))
    return SimResult(records, summarize(records), fleet)
