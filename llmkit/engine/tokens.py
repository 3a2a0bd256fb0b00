"""Token lists compared: the one comparison the slots, the scheduler and the prompt cache all make."""

from __future__ import annotations


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (llama-server: server_tokens::get_common_prefix)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
