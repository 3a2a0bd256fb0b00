"""The slot engine (~ llama-server's server-context.cpp + server-queue.cpp).

config.py        EngineConfig: the engine's settings, llama-server's flags, checked once
request.py       RequestParams (task_params), End (stop_type), Outcome, one request's channel (sync/async iteration)
slot.py          one slot, the KV sequence: cached tokens, prefix match, cache reuse, context shift
job.py           the run of a request on a slot: sampler, detokenizer, stop strings, progress, timings
scheduler.py     the scheduling Policy (llama-server's, shortest-prompt, fair-share, priority), admission,
                 choose_slot, swaps_prompt (get_available_slot), build_batch: the step's plan (pre_decode)
prompt_cache.py  the host-RAM prompt cache (server_prompt_cache)
kv_events.py     KV events: what the slots and the prompt cache hold, as vLLM's block events (llmkit's own, off by default)
speculative.py   draft-free speculative decoding: SpecParams, the n-gram drafters (common/speculative.cpp)
status.py        Counters, StepRecord, EngineStatus: what the engine tells (a snapshot its thread publishes)
engine.py        the loop: step = admit + update_slots (plan, decode, commit, sample); start=False to step by hand
"""

from llmkit.engine.config import EngineConfig
from llmkit.engine.engine import Engine
from llmkit.engine.request import ContextSizeError, End, EngineError, KVState, Outcome, Piece, Request, RequestParams, Status
from llmkit.engine.scheduler import FairShare, LlamaServerPolicy, Policy, PriorityPolicy, ShortestPromptFirst
from llmkit.engine.status import Counters, EngineStatus, SlotStatus, StepRecord

__all__ = [
    "Counters", "ContextSizeError", "End", "Engine", "EngineConfig", "EngineError", "EngineStatus", "FairShare", "KVState",
    "LlamaServerPolicy", "Outcome", "Piece", "Policy", "PriorityPolicy", "Request", "RequestParams",
    "ShortestPromptFirst", "SlotStatus", "Status", "StepRecord",
]  # fmt: skip
