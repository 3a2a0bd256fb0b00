"""The slot engine (~ llama-server's server-context.cpp + server-queue.cpp)."""

from llmkit.engine.config import EngineConfig
from llmkit.engine.engine import Engine
from llmkit.engine.request import ContextSizeError, End, EngineError, Piece, Request, RequestParams, Status, Timings
from llmkit.engine.status import Counters, EngineStatus, SlotStatus, StepRecord

__all__ = [
    "Counters", "ContextSizeError", "End", "Engine", "EngineConfig", "EngineError", "EngineStatus", "Piece", "Request",
    "RequestParams", "SlotStatus", "Status", "StepRecord", "Timings",
]  # fmt: skip
