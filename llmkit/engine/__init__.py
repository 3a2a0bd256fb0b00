"""The slot engine (~ llama-server's server-context.cpp + server-queue.cpp)."""

from llmkit.engine.engine import Counters, Engine, StepRecord
from llmkit.engine.request import ContextSizeError, EngineError, Piece, Request, Status, Timings

__all__ = ["Counters", "ContextSizeError", "Engine", "EngineError", "Piece", "Request", "Status", "StepRecord", "Timings"]
