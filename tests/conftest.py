"""Shared fixtures: the real embedded model and real servers on loopback ports."""

from __future__ import annotations

import pytest

from llmkit import launch, models


@pytest.fixture(scope="session")
def model_path():
    return models.default_model_path()


@pytest.fixture(scope="session")
def model(model_path):
    from llmkit.llama import Model

    with Model(model_path) as m:
        yield m


@pytest.fixture(scope="session")
def sequential_server():
    """The sequential translation server as a child process (greedy, so outputs repeat)."""
    with launch.serve("sequential", "--temp", "0", "--seed", "1") as server:
        yield server
