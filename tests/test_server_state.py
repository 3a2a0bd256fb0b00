"""The real engine is what the slot server's routes expect (``llmkit.server.state.ServingEngine``), as the tests' fake is."""

from __future__ import annotations

from llmkit.engine import Engine, EngineConfig
from llmkit.server.state import ServingEngine


def test_the_engine_is_an_engine_as_the_routes_see_it(model_path):
    with Engine(model_path, EngineConfig(n_parallel=1, n_ctx=256, n_threads=1)) as engine:
        assert isinstance(engine, ServingEngine)
