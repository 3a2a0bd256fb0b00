"""The slot engine (~ llama-server's server-context.cpp + server-queue.cpp).

config.py        EngineConfig: the engine's settings, llama-server's flags, checked once
request.py       RequestParams (task_params), End (stop_type), Outcome, one request's channel (sync/async iteration)
slot.py          one slot, the KV sequence: cached tokens, prefix match, cache reuse, context shift
job.py           the run of a request on a slot: sampler, detokenizer, stop strings, progress, timings
policy.py        the scheduling Policy (llama-server's, shortest-prompt, fair-share, priority, lpm), choose_slot
                 (get_available_slot): pure decisions, a policy of your own in their place
memory.py        KVMemory: what the scheduler asks of the KV cache (llama.Context satisfies it; the simulation too)
scheduler.py     the Scheduler: queue, slots, prompt cache; admission, preemption, prefix sharing, the step's plan
                 (build_batch ~ pre_decode) and its commit, and the one place a request ends
sharing.py       kv_share's decisions (llmkit's own): whose cells a prompt takes, who waits for cells being read,
                 which prefixes stay resident beside the slots and which go first (SGLang's radix cache)
prompt_cache.py  the host-RAM prompt cache (server_prompt_cache)
kv_events.py     KV events: what the slots and the prompt cache hold, as vLLM's block events (llmkit's own, off by default)
plugins.py       a plug-in by name: a built-in one's, or package.module:Name (the CLI's --scheduling-policy, --drafter, ...)
speculative.py   draft-free speculative decoding: SpecParams, the n-gram drafters (common/speculative.cpp)
tokens.py        common_prefix: the one comparison of token lists (server_tokens::get_common_prefix)
steps.py         StepRecord, Counters: what each step did, the totals (/metrics)
status.py        EngineStatus: what the engine tells (a snapshot its thread publishes)
engine.py        the runner and its loop: step = admit + update_slots (the scheduler's plan, decode, commit, sample);
                 start=False to step by hand
testing.py       slots and jobs in hand-made states (reading, generating, running), for tests and exercises
"""

from llmkit.engine.config import EngineConfig
from llmkit.engine.engine import Engine
from llmkit.engine.policy import FairShare, LlamaServerPolicy, LongestPrefixMatch, Policy, PriorityPolicy, ShortestPromptFirst
from llmkit.engine.request import ContextSizeError, End, EngineError, KVState, Outcome, Piece, Request, RequestParams, Status
from llmkit.engine.scheduler import Scheduler
from llmkit.engine.status import EngineStatus, SlotStatus
from llmkit.engine.steps import Counters, StepRecord

__all__ = [
    "Counters", "ContextSizeError", "End", "Engine", "EngineConfig", "EngineError", "EngineStatus", "FairShare", "KVState",
    "LlamaServerPolicy", "LongestPrefixMatch", "Outcome", "Piece", "Policy", "PriorityPolicy", "Request", "RequestParams",
    "Scheduler", "ShortestPromptFirst", "SlotStatus", "Status", "StepRecord",
]  # fmt: skip
