"""Every exercise's check, on the real model and real servers: the hidden solution passes it; a plausible wrong answer
fails it, with a message that does not give the answer away; an empty answer cell is "not answered yet".

The checks share their servers (``LAB``: one slot server, one llama-server, ... started once for the module) and their
measurements (each measured once, as in a learner's kernel); the model-free checks are tests/test_exercises.py's.
"""

from __future__ import annotations

import openai
import pytest

from llmkit.course import exercises
from llmkit.course.exercises import done
from llmkit.course.exercises.context import names_for
from llmkit.course.exercises.lab import LAB
from llmkit.course.exercises.verdict import FAIL, PASS, UNANSWERED
from llmkit.engine.policy import LlamaServerPolicy, choose_slot

import wrong_answers as wrong
from solutions import answers_of

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module", autouse=True)
def lab(tmp_path_factory):
    """One lab for the module: its servers and measurements shared by every check, stopped at the end."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(done.ENV, str(tmp_path_factory.mktemp("progress") / "progress.json"))
        yield LAB
    LAB.close()


def context(chapter: int) -> dict:
    """What a chapter's solution cells use from its earlier cells: what a grading run gives an answer cell."""
    return names_for(chapter)


# (chapter, exercise) -> (wrong answers: a function of the solution's answers, strings a wrong answer's message must not hold)
WRONG = {
    (1, 1): (lambda sol: [(wrong.FailsLate, 200), (sol[0], 500)], ["200"]),
    (1, 2): (lambda sol: [1.0], []),
    (1, 3): (lambda sol: [(True, False)], []),
    (2, 1): (lambda sol: [lambda response: response.json()["error"]], []),
    (2, 2): (lambda sol: [(True, "stop"), (False, "stop_sequence")], ["'stop'"]),
    (2, 3): (lambda sol: [(openai.APIStatusError, sol[1]), (sol[0], lambda exc: 2048)], ["BadRequestError", "1024"]),
    (2, 4): (lambda sol: [lambda answer: answer["usage"]["input_tokens"]], ["cache_read_input_tokens"]),
    (2, 5): (lambda sol: [wrong.only_the_status], ["output_tokens"]),
    (3, 1): (lambda sol: [{"events_of": True, "naive_parse": True, "sse_parse": True}], []),
    (3, 2): (lambda sol: [True], []),
    (3, 3): (lambda sol: [(True, False)], []),
    (3, 4): (lambda sol: [wrong.split_each_read, wrong.drops_the_last_event], []),
    (4, 1): (lambda sol: [([64, 64, 64, 64, 44], [300])], ["62", "52"]),
    (4, 2): (lambda sol: [(2, 3), (6, 4)], []),
    (4, 3): (lambda sol: [{"llama-server -b 2048": 1, "llama-server -b 128": 11, "slot server": 11}], []),
    (4, 4): (lambda sol: [wrong.ArrivalOrder, LlamaServerPolicy], ["[2, 6, 12, 40]"]),
    (5, 1): (lambda sol: [lambda n: n // 10], []),
    (5, 2): (lambda sol: [(0.5, 0, 0), (sol[0], 12, 0)], []),
    (5, 3): (lambda sol: [(3 * sol[0], sol[1])], []),  # every head counted, not the KV heads
    (5, 4): (lambda sol: [wrong.prompt_cache_without_the_quarter], []),
    (5, 5): (lambda sol: [wrong.cells_with_the_last_token, wrong.cells_shared_per_request], []),
    (6, 1): (lambda sol: [('root ::= [0-9] [0-9] [0-9] [0-9] "-" [0-9] [0-9] "-" [0-9] [0-9]', sol[1]), (sol[0], "length")], []),
    (6, 2): (
        lambda sol: [(sol[0], False), ({**sol[0], "properties": {**sol[0]["properties"], "confidence": {"type": "number"}}}, True)],
        [],
    ),
    (6, 3): (
        lambda sol: [
            ({**sol[0], "parameters": {**sol[0]["parameters"], "required": ["city"]}}, sol[1]),
            (sol[0], '"celsius" | "fahrenheit"'),
        ],
        [],
    ),
    (6, 4): (lambda sol: [2], []),
    (6, 5): (lambda sol: [False], []),
    (7, 1): (lambda sol: [(False, sol[1]), (True, {**sol[1], "llmkit --cache-ram 0": 0.9, "llama-server --cache-ram 0": 0.9})], []),
    (7, 2): (lambda sol: [(4096, sol[1]), (sol[0], {"llmkit": False, "llama-server": False})], ["2048"]),
    (7, 3): (lambda sol: [lambda n_prompt, n_batch: n_prompt // n_batch], []),
    (7, 4): (lambda sol: [{"llmkit": "tool_use", "llama-server": "tool_use"}], ["'text'"]),
    (7, 5): (lambda sol: [choose_slot], []),  # llmkit's rule, where it differs from llama-server's
    (8, 1): (lambda sol: [4.0], []),
    (8, 2): (lambda sol: [wrong.blocking_batch_route, wrong.threaded_batch_route_with_a_typo], []),
    (8, 3): (lambda sol: [wrong.ReleasesAtOnce], []),
    (9, 1): (lambda sol: [{12: sol[0][2], 2: sol[0][12]}, {12: 0.5, 2: 0.5}, True], []),
    (9, 2): (lambda sol: [(5, True), (4, False)], []),
    (9, 3): (lambda sol: [lambda draft, sampled, is_eog: sampled[: len(draft) + 1]], []),
    (9, 4): (lambda sol: [wrong.LookupInEverything], []),
    (10, 1): (lambda sol: [wrong.key_from_the_user_field, wrong.key_by_the_order_given], []),
    (10, 2): (lambda sol: [wrong.blocks_per_slot(), wrong.blocks_by_their_own_tokens()], []),  # per-slot caches; the router's keys
    (10, 3): (
        lambda sol: [
            wrong.event_with(sol[0], source="worker"),
            wrong.event_with(sol[0], token_ids=[]),
            wrong.names_of_each_block_alone,
            wrong.names_at_random,
        ],
        [],
    ),
}
ALL = [ex for ch in exercises.chapters() for ex in ch]


def test_every_exercise_has_its_case_here():
    assert sorted(WRONG) == sorted((ex.chapter, ex.number) for ex in ALL)


@pytest.mark.parametrize("ex", ALL, ids=lambda ex: f"{ex.chapter}.{ex.number}")
def test_the_solution_passes_a_wrong_answer_fails_an_empty_one_is_not_answered(ex):
    solution = answers_of(ex, context(ex.chapter))
    verdict = ex.verdict(*solution)
    assert verdict.status == PASS, verdict
    make_wrong, forbidden = WRONG[ex.chapter, ex.number]
    for answer in make_wrong(solution):
        answers = answer if isinstance(answer, tuple) and len(ex.answers) > 1 else (answer,)
        verdict = ex.verdict(*answers)
        assert verdict.status == FAIL, (answer, verdict)
        assert not [f for f in forbidden if f in verdict.message], verdict.message
    assert ex.verdict(*[...] * len(ex.answers)).status == UNANSWERED
