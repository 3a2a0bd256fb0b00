"""Your own code in the slot server's seams, given on the command line as ``package.module:Name`` (one real server).

The plug-ins are observable from outside: the sampler always picks "!" (but for a request of seed ``NO_TOKEN_SEED``,
where it returns the vocabulary's size, no token id), the stop matcher stops at "!!!" whatever the request asked, the
drafter guesses the last token again (so every draft is accepted), the policy is a subclass by its own name;
``/props`` names each one."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llmkit.course import launch

NO_TOKEN_SEED = 666
PLUG_INS = f'''
from llmkit.engine import LlamaServerPolicy
from llmkit.sampling import Sampler
from llmkit.text import StopMatcher


class Mine(LlamaServerPolicy):
    name = "mine"


class Bang(Sampler):
    """Always "!" (after the real chain has run: its penalties and grammar stay in step); no token id for one seed."""

    def __init__(self, model, params):
        super().__init__(model, params)
        self.bang = model.n_vocab if params.seed == {NO_TOKEN_SEED} else model.tokenize("!", add_special=False)[-1]

    def sample(self, ctx, row):
        super().sample(ctx, row)
        return self.bang


def three_bangs(stops):
    return StopMatcher(["!!!"])


class Again:
    n_max = 3

    def begin(self, seq, prompt):
        pass

    def draft(self, seq, tokens, last, n_max):
        return [last] * n_max

    def accept(self, seq, n_drafted, n_accepted):
        pass
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plugins")
    (folder / "my_parts.py").write_text(PLUG_INS)
    flags = ("-np", "2", "-c", "2048", "-t", "1", "--scheduling-policy", "my_parts:Mine", "--sampler", "my_parts:Bang",
             "--stop-matcher", "my_parts:three_bangs", "--drafter", "my_parts:Again")  # fmt: skip
    with launch.serve("slots", *flags, env={"PYTHONPATH": str(folder)}) as s:
        yield s


def test_plug_ins_given_as_module_colon_name_are_used_and_named_in_props(server):
    answer = httpx.post(f"{server.url}/completion", json={"prompt": "Say hello", "n_predict": 20}, timeout=120).json()
    # Bang's "!", three times, is three_bangs' stop word: the text before it is empty (however the request asked)
    assert (answer["content"], answer["stop_type"], answer["stopping_word"]) == ("", "word", "!!!"), answer
    assert answer["timings"]["draft_n"] > 0 and answer["timings"]["draft_n_accepted"] == answer["timings"]["draft_n"]  # Again
    engine = httpx.get(f"{server.url}/props", timeout=30).json()["engine"]
    assert (engine["policy"], engine["sampler"], engine["stop_matcher"], engine["drafter"], engine["cache_choice"]) == (
        "mine", "my_parts.Bang", "my_parts.three_bangs", "my_parts.Again", "llmkit.engine.prompt_cache.choose_entry",
    )  # fmt: skip


def test_a_sampler_that_returns_no_token_id_fails_its_own_request_alone(server):
    # llama.cpp would abort the process on it (token_to_piece), or fail the next step's batch (llama_decode): here the
    # request whose sampler did it fails with the reason, and the other one, sent with it to the other slot, is answered
    def ask(seed: int) -> httpx.Response:
        return httpx.post(f"{server.url}/completion", json={"prompt": "Say hello", "n_predict": 20, "seed": seed}, timeout=120)

    with ThreadPoolExecutor(2) as pool:
        broken, fine = pool.map(ask, (NO_TOKEN_SEED, 1))
    assert broken.status_code == 500, broken.text
    n_vocab = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["meta"]["n_vocab"]
    said = f"the sampler my_parts.Bang returned {n_vocab}, not a token id of this model's vocabulary (0 to {n_vocab - 1})"
    assert said in broken.json()["error"]["message"], broken.text
    assert (fine.status_code, fine.json()["stop_type"], fine.json()["stopping_word"]) == (200, "word", "!!!"), fine.text
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200 and server.running()


def test_a_plug_in_that_cannot_be_loaded_is_refused_at_start_with_its_reason():
    for flag, value, said in (("--drafter", "no_such_module:X", "No module named"), ("--scheduling-policy", "fifo", "unknown")):
        process = launch.spawn("slots", flag, value)
        process.process.wait(timeout=60)
        assert process.process.returncode == 2 and said in process.log_path.read_text()
