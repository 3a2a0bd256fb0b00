"""Shared fixtures: the real embedded model and real servers on loopback ports."""

from __future__ import annotations

import pytest

from llmkit import models
from llmkit.course import launch


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
    """The sequential translation server as a child process.

    Greedy (outputs repeat), at most 160 tokens per translation, one thread:
    two servers and the test process share two cores, and llama.cpp's
    threads slow down badly when they have to wait for a core.
    """
    with launch.serve("sequential", "--temp", "0", "--seed", "1", "-n", "160", "-t", "1") as server:
        yield server


@pytest.fixture(scope="session")
def slot_server():
    """The slot server the test modules of its HTTP behaviour share (test_server.py, test_server_overload.py): 4 slots
    of 512 tokens, greedy, /metrics on, the alias ``smollm2``, one CPU thread."""
    flags = ("-c", "2048", "-np", "4", "-t", "1", "--temp", "0", "--seed", "1", "--metrics", "--alias", "smollm2")
    with launch.serve("slots", *flags) as server:
        yield server


# The inner loop: `make test-fast` runs these modules only (no model, server, browser or build;
# seconds). Every other test, and every notebook, is marked `slow`; `make test` runs everything.
FAST_MODULES = {
    *("test_scheduler.py", "test_drafts.py", "test_sse.py", "test_text.py", "test_server_app.py", "test_models.py", "test_tools.py"),
    "test_options.py",  # every body field read or HTTP-only; one serializer of the settings
    "test_hostile.py",  # hostile bodies on every route of the slot server, over a scripted engine
    *("test_notebooks.py", "test_course.py", "test_japanese.py"),  # the notebooks as files, the editions' labels and terms
    "test_layout.py",  # the runtime apart from the course's apparatus, and one map of the package
    "test_trace.py",  # the multi-tenant trace and its summary (the replay itself: test_fleet.py)
    "test_kv_events.py",  # the KV events on hand-made slots, their wire on loopback ZMQ sockets
    "test_kv_share.py",  # shared prefix cells on a model of the unified KV cache
    "test_sim.py",  # the fleet model (its one test on the real model is marked slow)
    "test_exercises.py",  # the exercises' pattern, hints, progress, student edition, and the checks that need no model
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name not in FAST_MODULES:
            item.add_marker(pytest.mark.slow)
