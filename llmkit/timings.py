"""llama-server's per-request ``timings`` object, which both servers report (the sequential server's ``cache_n`` stays 0)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Timings:
    """What one request cost, as llama-server's ``timings`` (``result_timings`` in server-task.h)."""

    cache_n: int = 0  # prompt tokens reused from the slot's KV cache (from the prefix and moved chunks)
    n_cache_reuse: int = 0  # llmkit's own: of those, tokens of chunks moved into place (--cache-reuse)
    prompt_n: int = 0  # prompt tokens evaluated
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int = 0  # tokens drafted by speculation (llama-server reports these two only when it drafted)
    draft_n_accepted: int = 0  # of which the model sampled too: each one a token without a step of its own

    def to_dict(self) -> dict:
        def per(n: int, ms: float) -> tuple[float, float]:
            return (ms / n if n else 0.0, 1e3 * n / ms if ms > 0 else 0.0)

        prompt_per_token_ms, prompt_per_second = per(self.prompt_n, self.prompt_ms)
        # over decode steps, as llama-server: the first token comes from the prompt's last step, not a step of its own
        predicted_per_token_ms, predicted_per_second = per(max(self.predicted_n - 1, 0), self.predicted_ms)
        return {
            "cache_n": self.cache_n,
            "n_cache_reuse": self.n_cache_reuse,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": prompt_per_token_ms,
            "prompt_per_second": prompt_per_second,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": predicted_per_token_ms,
            "predicted_per_second": predicted_per_second,
        } | ({"draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted} if self.draft_n else {})
