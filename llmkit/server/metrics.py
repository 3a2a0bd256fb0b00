"""``GET /metrics``: the engine's counters in Prometheus text, under llama-server's ``llamacpp:`` names.

(~ llama-server's ``server_task_result_metrics::to_metrics`` in server-task.cpp.)
A prometheus_client collector reads the engine status that the route waited for
(``ServerState.status``, off the event loop) at scrape time, so the numbers are exactly the engine's totals (the sums of every finished
request's ``timings``). Its own registry: nothing of the process leaks in.

One difference from llama-server's hand-written text: prometheus_client names
every counter ``..._total``, as the exposition format prescribes, so llama-server's
counter ``n_tokens_max`` (a maximum, not a count) is a gauge here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmkit.engine import EngineStatus

PREFIX = "llamacpp:"

COUNTERS = {  # counter name -> its help text (the same words as llama-server's)
    "prompt_tokens_total": "Number of prompt tokens processed, excluding cached tokens",
    "prompt_tokens_cached_total": "Number of prompt tokens reused from the cache",
    "prompt_seconds_total": "Total time spent processing prompts",
    "tokens_predicted_total": "Number of generation tokens processed",
    "tokens_predicted_seconds_total": "Total time spent generating tokens",
    "n_decode_total": "Total number of llama_decode() calls",
    "spec_decode_num_draft_tokens_total": "Speculative: Total draft tokens generated",
    "spec_decode_num_accepted_tokens_total": "Speculative: Total draft tokens accepted by the target model",
    "spec_decode_num_drafts_total": "Speculative: Total speculative decoding verification steps",
    # llmkit's own (not in llama-server): their ratio is Python's share of each engine step
    "decode_seconds_total": "Time spent inside llama_decode()",
    "step_seconds_total": "Time spent in engine steps (llama_decode + Python)",
    "batch_prompt_tokens_total": "Prompt tokens put in llama_decode() batches",
    "batch_generated_tokens_total": "Tokens of generating slots put in llama_decode() batches (one per slot per step, plus drafts)",
    "requests_preempted_total": "Running requests that left their slot for one of a higher priority (--scheduling-policy priority)",
    "prompt_tokens_shared_total": "Prompt tokens whose KV cells a slot took from another slot instead of reading them (--kv-share)",
}


def gauges(status: EngineStatus) -> dict[str, tuple[str, float]]:
    c = status.counters

    def rate(n: float, seconds: float) -> float:
        return n / seconds if seconds else 0.0

    cache = status.prompt_cache or {}
    return {  # name -> (help text, value)
        "prompt_tokens_seconds": ("Average prompt throughput in tokens/s", rate(c.prompt_tokens_total, c.prompt_seconds_total)),
        "predicted_tokens_seconds": (
            "Average generation throughput in tokens/s",
            rate(c.tokens_predicted_total, c.tokens_predicted_seconds_total),
        ),
        "requests_processing": ("Number of requests processing", status.n_busy),
        "requests_deferred": ("Number of requests deferred", status.n_waiting),
        # a counter in llama-server's text; a gauge here: prometheus_client names every counter ..._total (the
        # exposition format's rule), and a maximum is not a count
        "n_tokens_max": ("Largest observed sequence length (prompt + generation)", c.n_tokens_max),
        "n_busy_slots_per_decode": (
            "Average number of busy slots per llama_decode() call",
            c.n_busy_slots_total / max(c.n_decode_total, 1),
        ),
        # llmkit's own: the host-RAM prompt cache (--cache-ram)
        "prompt_cache_bytes": ("Bytes held by the prompt cache", cache.get("bytes", 0)),
        "prompt_cache_prompts": ("Prompts held by the prompt cache", cache.get("n_prompts", 0)),
        # llmkit's own: the KV cells the slots hold, a shared prefix's once (--kv-share)
        "kv_cells_used": ("KV cells held by the slots, each counted once", status.cells.used),
        "kv_cells_shared": ("KV cells held by two slots or more (--kv-share)", status.cells.shared),
        "kv_cells_idle": ("KV cells held by idle slots alone: resident for a later request", status.cells.idle),
    }


PROMPT_CACHE_COUNTERS = {  # the host-RAM prompt cache's totals (--cache-ram), as prompt_cache_<name>_total: not in llama-server
    "hits": "Prompts restored from the prompt cache into a slot",
    "misses": "Prompt cache lookups that found nothing better than what the slot held",
    "evictions": "Prompts evicted from the prompt cache to stay within --cache-ram",
}


class EngineCollector:
    """A prometheus_client collector over an engine's status (found through ``get_status`` at each scrape)."""

    def __init__(self, get_status: Callable[[], EngineStatus | None]):
        self.get_status = get_status

    def collect(self) -> Iterator[Metric]:
        status = self.get_status()
        if status is None:  # no engine yet: the gate answers 503 before a scrape gets here
            return
        totals = status.counters.snapshot()
        for name, help_text in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, help_text, value=totals[name])
        for name, (help_text, value) in gauges(status).items():
            yield GaugeMetricFamily(PREFIX + name, help_text, value=value)
        cache = status.prompt_cache or {}
        for name, help_text in PROMPT_CACHE_COUNTERS.items():
            yield CounterMetricFamily(f"{PREFIX}prompt_cache_{name}_total", help_text, value=cache.get(name, 0))


def registry(get_status: Callable[[], EngineStatus | None]) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(get_status))
    return reg


def app_registry(request: Request) -> CollectorRegistry:
    """The app's registry (``app.py`` builds it): a route's dependency."""
    return request.app.state.metrics


Registry = Annotated[CollectorRegistry, Depends(app_registry)]


def render(reg: CollectorRegistry) -> tuple[bytes, str]:
    """The exposition text and its content type."""
    return generate_latest(reg), CONTENT_TYPE_LATEST
