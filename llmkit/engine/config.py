"""The engine's settings in one place: ``EngineConfig`` (~ the part of llama-server's ``common_params`` its flags
set for the slots). The CLI builds one from its flags, the engine checks it once, ``/props`` reports it.

    Engine(model, EngineConfig(n_parallel=2, n_ctx=4096))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from llmkit.engine.kv_events import DEFAULT_BLOCK_SIZE
from llmkit.engine.policy import LlamaServerPolicy, Policy
from llmkit.engine.prompt_cache import Choice, choose_entry
from llmkit.engine.speculative import Drafter, SpecParams, SpecType
from llmkit.llama import Model
from llmkit.sampling import Sampler, SamplingParams
from llmkit.text import StopMatcher

# Tokens per step beside a running stream, by default: a step that reads a prompt chunk costs about as much as
# its tokens, so this bounds the pause that a burst of long prompts puts between two tokens of a running stream
# (chapter 4 measures it beside llama-server at -b 2048 and -b 128; make bench's arrivals scenario too).
DEFAULT_STEP_TOKENS = 128
AUTO_PARALLEL = 4  # slots of n_parallel=-1 (auto), as llama-server's -np -1
LLAMA_MAX_SEQ = 256  # sequences a llama.cpp context can have (src/llama-cparams.h)


@dataclass(frozen=True)
class EngineConfig:
    """Each field is a llama-server flag (named in its comment), with its default, but for ``step_tokens``.

    ``n_ctx`` is the TOTAL context. As llama-server, ``n_parallel=-1`` (auto) means 4 slots
    on a unified KV cache: each slot may use all of ``n_ctx``, and idle slots are cleared
    when it runs out. An explicit ``n_parallel`` gives each slot ``n_ctx // n_parallel``
    tokens in its own KV stream (``kv_unified=False``).

    ``step_tokens`` (llmkit's own) is the token budget of one step while streams run
    (``scheduler.build_batch``): running streams first, then prompt chunks. 0 puts up to
    ``n_batch`` prompt tokens in a step, as llama-server does, and running streams wait for it.

    The KV cache, as llama-server (the caching chapter shows each): ``cache_ram_mib``
    bounds the host-RAM prompt cache (0: off, -1: no limit in bytes); ``cache_idle_slots``
    copies idle slots to it when a request starts; ``cache_reuse`` > 0 moves cached chunks
    of at least that many tokens into place; ``context_shift`` lets a generation go past a
    full slot by dropping tokens after ``n_keep``.

    ``speculative``: draft-free speculative decoding (``--spec-type ngram-simple | ngram-mod``, off by
    default as in llama-server): ``llmkit.engine.speculative``.

    ``kv_events`` (llmkit's own; llama-server has none): at the end of each step, tell what the slots and the prompt
    cache now hold as blocks of ``kv_block_size`` tokens (``Engine.kv_events``; ``llmkit.engine.kv_events``), for a
    router's ``kv_aware`` policy (the server publishes them: ``--kv-events``).

    ``kv_share`` (llmkit's own, beyond llama-server; needs ``kv_unified``): a request takes the cells of its prompt's
    longest prefix that any slot holds, running or idle, with ``seq_cp`` (one set of cells, several sequences: no
    compute, no copy) and reads only the rest; idle slots keep their cells for that until the cache needs the room;
    a request whose prefix another slot is reading now waits for those cells instead of reading them too (SGLang's
    radix cache and in-batch prefix caching, on llama.cpp's unified KV cache). Before a slot drops cells no other
    sequence holds, one of ``kv_resident`` more sequences keeps them (no copy: ``seq_cp``), so up to that many
    prefixes no request uses stay resident beside the slots' own, until the cache needs the room (least recently
    used first, as SGLang evicts its radix tree's unreferenced leaves).

    The plug-ins (llmkit's own), each a seam for your own code, each reported by name in ``/props`` (``PLUG_INS``):
    ``policy``, who goes first, which slot a request gets, which running job makes room for it, whose prompt fills a
    step first (``llmkit.engine.policy``: llama-server's rules, or your own); ``drafter``, a speculation mode of your
    own (it says its ``n_max``; None: ``speculative``'s); ``sampler`` and ``stop_matcher``, what each request's job
    samples with and matches stop strings with; ``cache_choice``, which cached prompt the prompt cache brings back
    (``prompt_cache.choose_entry``: llama-server's rule).
    """

    n_parallel: int = -1  # -np
    n_ctx: int = 8192  # -c
    n_batch: int = 2048  # -b
    n_threads: int | None = None  # -t (None: every core)
    kv_unified: bool | None = None  # -kvu (None: on with -np auto, off with -np N)
    step_tokens: int = DEFAULT_STEP_TOKENS
    cache_ram_mib: int = 8192  # --cache-ram
    cache_idle_slots: bool = True  # --cache-idle-slots
    cache_reuse: int = 0  # --cache-reuse
    context_shift: bool = False  # --context-shift
    speculative: SpecParams = field(default_factory=SpecParams)  # --spec-type and its --spec-ngram-* settings
    policy: Policy = field(default_factory=LlamaServerPolicy)  # llmkit's --scheduling-policy: llama-server's rules by default
    kv_events: bool = False  # llmkit's --kv-events (the engine's half: the events; the server publishes them)
    kv_block_size: int = DEFAULT_BLOCK_SIZE  # llmkit's --kv-block-size: tokens per block of the KV events
    kv_share: bool = False  # llmkit's --kv-share: prefixes' KV cells shared by the slots (needs kv_unified)
    kv_resident: int = 16  # llmkit's --kv-resident: with kv_share, sequences that keep prefixes no slot holds
    drafter: Drafter | None = None  # llmkit's --drafter: your own speculation (None: --spec-type's)
    sampler: Callable[[Model, SamplingParams], Sampler] = Sampler  # each request's sampler, from its sampling settings
    stop_matcher: Callable[[tuple[str, ...]], StopMatcher] = StopMatcher  # each request's stop-string matcher
    cache_choice: Choice = choose_entry  # which cached prompt the prompt cache brings back (llama-server's rule)

    @property
    def n_seq_max(self) -> int:
        """The KV cache's sequences: one a slot, and with ``kv_share`` the resident prefixes' (llama.cpp's n_seq_max)."""
        return self.n_parallel + (self.kv_resident if self.kv_share else 0)

    @property
    def speculates(self) -> bool:
        return self.drafter is not None or self.speculative.type is not SpecType.NONE

    def to_dict(self) -> dict:
        """Every setting, as ``/props`` reports it (the plug-ins and the speculation mode by their names)."""
        settings = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in PLUG_INS}
        settings["speculative"] = asdict(self.speculative) | {"type": self.speculative.type.value}
        return settings | {name: name_of(getattr(self, name)) for name in PLUG_INS}

    def resolved(self) -> EngineConfig:
        """Checked (``ValueError`` says what is wrong), with the automatic settings made concrete."""
        if self.n_parallel == 0 or self.n_parallel < -1:
            raise ValueError(f"n_parallel must be -1 (auto) or at least 1, not {self.n_parallel}")
        n_parallel = AUTO_PARALLEL if self.n_parallel == -1 else self.n_parallel
        if self.step_tokens and self.step_tokens < 2 * n_parallel:  # room for every running stream and a prompt chunk
            raise ValueError(f"step_tokens must be 0 (no budget) or at least 2 x n_parallel = {2 * n_parallel}, not {self.step_tokens}")
        if self.n_ctx < n_parallel or self.n_batch < 1:
            raise ValueError(f"n_ctx ({self.n_ctx}) must hold a token per slot, and n_batch ({self.n_batch}) be at least 1")
        if self.kv_block_size < 1:
            raise ValueError(f"kv_block_size must be at least 1, not {self.kv_block_size}")
        if self.cache_reuse < 0:
            raise ValueError(f"cache_reuse must be 0 (off) or a number of tokens, not {self.cache_reuse}")
        self.speculative.checked()
        kv_unified = self.n_parallel == -1 if self.kv_unified is None else self.kv_unified
        if self.kv_share and not kv_unified:
            raise ValueError("kv_share needs a unified KV cache (kv_unified, -kvu): separate streams share no cells")
        if not 0 <= self.kv_resident <= LLAMA_MAX_SEQ - n_parallel:
            raise ValueError(f"kv_resident must be 0 to {LLAMA_MAX_SEQ - n_parallel}: {LLAMA_MAX_SEQ} sequences, less the slots'")
        return replace(
            self, n_parallel=n_parallel, kv_unified=kv_unified, cache_idle_slots=self.cache_idle_slots and self.cache_ram_mib != 0
        )


PLUG_INS = ("policy", "drafter", "sampler", "stop_matcher", "cache_choice")


def name_of(part: Any) -> str | None:
    """How ``/props`` names a plug-in: its ``name`` if it has one (a policy), else its class or function's path."""
    if part is None:
        return None
    if isinstance(getattr(part, "name", None), str):
        return part.name
    made = part if callable(part) and hasattr(part, "__qualname__") else type(part)
    return f"{made.__module__}.{made.__qualname__}"
