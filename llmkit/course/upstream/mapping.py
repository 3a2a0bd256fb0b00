"""Which llmkit code does the job of which llama-server code: the one map the course and the docstrings use.

Each row pairs an llmkit symbol (a dotted path; a function nested in another
is written ``module.outer.inner``) with a C++ symbol in the pinned llama.cpp
and says in one line what differs. It also names a code fragment of each side
that shows the two do the same job (``in_upstream``, ``in_llmkit``: the
``n_cache_reuse`` test of the chunk loop, say). ``tests/test_upstream.py``
checks every row both ways (the C++ exists in the source and holds its
fragment, the Python exists in llmkit and holds its own) and that every
llama-server name in llmkit's docstrings and comments is here.

    for row in MAP: print(row.llmkit, "~", row.upstream)
    counterparts("llmkit.engine.scheduler.build_batch")
"""

from __future__ import annotations

import ast
import importlib
import inspect
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

from llmkit.course import tr
from llmkit.course.upstream.cpp import Symbol

ROOT = Path(__file__).resolve().parents[3]  # the folder that holds llmkit/: a Symbol's path is relative to it

CONTEXT = "tools/server/server-context.cpp"
QUEUE = "tools/server/server-queue.cpp"
COMMON = "tools/server/server-common.cpp"
TASK = "tools/server/server-task.cpp"
MODELS = "tools/server/server-models.cpp"


@dataclass(frozen=True)
class Counterpart:
    llmkit: str  # dotted path of a module-level or nested function, class or method
    upstream: str  # qualified C++ name, as llmkit.course.upstream.find() takes it
    file: str  # where upstream lives, relative to llama.cpp's root
    differs: str  # what llmkit does differently, in one line (English: the key of its translation)
    _: KW_ONLY
    in_upstream: str  # a fragment of upstream's code (not its head) that shows the job: the wrong function would not hold it
    in_llmkit: str  # the fragment of llmkit's code that does the same

    @property
    def what_differs(self) -> str:
        """``differs`` in the reader's language (``llmkit.course.tr``; Japanese: notebooks/ja/locale/llmkit.po)."""
        return tr(self.differs)


# A request's path in order: queue and loop, slot choice, batch, decode, sampling, answer; then the HTTP side.
MAP: tuple[Counterpart, ...] = (
    Counterpart("llmkit.engine.engine.Engine.submit", "server_response_reader::post_task", QUEUE,
                "refuses a prompt too long for a slot before it is queued (llama-server: in pre_decode, once a slot has the task); "
                "appends to the engine's arrivals, which join the scheduler's queue at the next step, where llama-server posts a "
                "task to server_queue",
                in_upstream="queue_tasks.post(", in_llmkit="self.arrivals.append(request)"),
    Counterpart("llmkit.engine.engine.Engine.loop", "server_queue::start_loop", QUEUE,
                "same shape (take new work, then one update); no idle sleep, no worker thread for yields; "
                "an idle loop also wakes to publish its status for a reader",
                in_upstream="condition_tasks.wait_for(", in_llmkit="self._work.wait_for("),
    Counterpart("llmkit.engine.scheduler.Scheduler.admit", "server_context_impl::process_single_task", CONTEXT,
                "only the completion case, in the scheduling policy's order: a request with no slot stays in the deque "
                "(llama-server defers it); a preempting policy can take a running job off its slot (llama-server never does)",
                in_upstream="launch_slot_with_task(*slot", in_llmkit="self.launch(found.slot, found.request)"),
    Counterpart("llmkit.engine.scheduler.admission", "server_context_impl::process_single_task", CONTEXT,
                "the choice alone, a pure function of the queue, the slots and the policy (llama-server: FIFO, then defer)",
                in_upstream="get_available_slot(task)", in_llmkit="policy.choose_slot(slots, request"),
    Counterpart("llmkit.engine.engine.Engine._publish", "server_context_impl::process_single_task", CONTEXT,
                "its SERVER_TASK_TYPE_METRICS case: the slots and counters read on the loop's thread, between two steps, "
                "for /slots and /metrics; here a snapshot the readers share",
                in_upstream="SERVER_TASK_TYPE_METRICS", in_llmkit="self._snapshot()"),
    Counterpart("llmkit.engine.policy.choose_slot", "server_context_impl::get_available_slot", CONTEXT,
                "same rules (id_slot, similarity > 0.1, least recently used), but a request with cache_prompt false "
                "skips the similarity rule (it reuses no prefix), and of idle slots equally old llmkit takes the first, "
                "llama-server the last (t_last_used <= t_last); the prompt-cache update is swaps_prompt + Scheduler.swap_prompt",
                in_upstream="f_sim_cur > slot_prompt_similarity", in_llmkit="> SIMILARITY_THRESHOLD"),
    Counterpart("llmkit.engine.scheduler.swaps_prompt", "server_context_impl::get_available_slot", CONTEXT,
                "its update_cache decision as a pure function (LRU, or similarity with f_keep < 0.5); also no without cache_prompt",
                in_upstream="f_keep < 0.5f", in_llmkit="< KEEP_THRESHOLD"),
    Counterpart("llmkit.engine.scheduler.Scheduler.swap_prompt", "server_context_impl::get_available_slot", CONTEXT,
                "the end of it: prompt_save, prompt_load (or nothing), prompt_cache->update",
                in_upstream="ret->prompt_load(*prompt_cache, task.tokens)", in_llmkit="slot.load_prompt(self.prompt_cache"),
    Counterpart("llmkit.engine.scheduler.Scheduler.save_idle_slots", "server_context_impl::process_single_task", CONTEXT,
                "its --cache-idle-slots block: idle slots copied to RAM, and cleared on a unified KV cache",
                in_upstream="params_base.cache_idle_slots", in_llmkit="self.config.cache_idle_slots"),
    Counterpart("llmkit.engine.prompt_cache.PromptCache", "server_prompt_cache", "tools/server/server-task.h",
                "a list of (tokens, state bytes), oldest first; no draft-model state, no checkpoints",
                in_upstream="std::list<server_prompt_cache_state> states", in_llmkit="self.entries: list[CachedPrompt]"),
    Counterpart("llmkit.engine.prompt_cache.PromptCache.load", "server_prompt_cache::load", TASK,
                "the same choice (f_keep >= 0.25, better f_keep and f_sim); a failed restore clears the sequence",
                in_upstream="f_keep_cur < 0.25f", in_llmkit="self.choose("),
    Counterpart("llmkit.engine.prompt_cache.PromptCache.save", "server_prompt_cache::alloc", TASK,
                "the same rules (skip if held, drop entries it contains, evict oldest to fit); copies the state itself",
                in_upstream="state_size_new > limit_size", in_llmkit="len(state) > self.limit_bytes"),
    Counterpart("llmkit.engine.prompt_cache.PromptCache.update", "server_prompt_cache::update", TASK,
                "the same byte limit, then the token limit estimated from it",
                in_upstream="limit_size/size_per_token", in_llmkit="self.limit_bytes / per_token"),
    Counterpart("llmkit.engine.slot.Slot.save_prompt", "server_slot::prompt_save", CONTEXT, "the same, through PromptCache.save",
                in_upstream="prompt_cache.alloc(", in_llmkit="cache.save("),
    Counterpart("llmkit.engine.slot.Slot.load_prompt", "server_slot::prompt_load", CONTEXT, "the same, and counts restores for /slots",
                in_upstream="prompt_cache.load(", in_llmkit="cache.load("),
    Counterpart("llmkit.engine.slot.Slot.share_from", "server_slot::copy_state_to", CONTEXT,
                "the same seq_rm then seq_cp, across requests (--kv-share): a new request takes the longest prefix any slot "
                "holds; llama-server copies a slot's cells only to the n > 1 children of its own task",
                in_upstream="mem.seq_cp(id, other.id, -1, -1)", in_llmkit="ctx.seq_cp(donor.id, self.id, 0, n)"),
    Counterpart("llmkit.engine.slot.Slot.clear_prompt", "server_slot::prompt_clear", CONTEXT, "the same",
                in_upstream="mem.seq_rm(id, -1, -1)", in_llmkit="ctx.seq_rm(self.id, 0, -1)"),
    Counterpart("llmkit.engine.slot.Slot.reuse_chunks", "server_context_impl::pre_decode", CONTEXT,
                "its n_cache_reuse loop (--cache-reuse), run when the request starts; counts the moved tokens for timings",
                in_upstream="n_match >= (size_t) n_cache_reuse", in_llmkit="n >= min_chunk"),
    Counterpart("llmkit.engine.slot.Slot.shift_context", "server_context_impl::pre_decode", CONTEXT,
                "its context shift (--context-shift): n_discard is always half of what follows n_keep",
                in_upstream="n_left / 2", in_llmkit="n_left // 2"),
    Counterpart("llmkit.engine.status.Counters.record_finish", "server_context_impl::metrics_on_prediction", CONTEXT,
                "the totals of a finished request's timings, in one writer; llama-server also counts prompts as their chunks are read",
                in_upstream="slot.stats.n_gen", in_llmkit="t.predicted_n"),
    Counterpart("llmkit.engine.scheduler.Scheduler.clear_idle_slot", "server_context_impl::try_clear_idle_slots", CONTEXT,
                "the same (unified KV only); Engine.decode then retries the whole batch instead of halving it",
                in_upstream="!params_base.kv_unified", in_llmkit="if self.config.kv_unified"),
    Counterpart("llmkit.engine.scheduler.Scheduler.launch", "server_context_impl::launch_slot_with_task", CONTEXT,
                "also keeps the cached prefix and drops the rest of the KV (Slot.reuse), which llama-server does in pre_decode; "
                "a preempted job goes on instead of a new one",
                in_upstream="slot.task = std::make_unique<const server_task>", in_llmkit="slot.job = job"),
    Counterpart("llmkit.engine.job.Job.start", "server_context_impl::launch_slot_with_task", CONTEXT,
                "the task's sampler, detokenizer and stop strings, in the request's run",
                in_upstream="common_sampler_init(model_tgt, task.params.sampling)", in_llmkit="sampler(model, params.sampling)"),
    Counterpart("llmkit.engine.slot.Slot.reuse", "server_context_impl::pre_decode", CONTEXT,
                "its n_past logic when a request starts: the common prefix, chunks moved (--cache-reuse), the rest dropped; "
                "at least one token left to evaluate",
                in_upstream="slot.prompt.tokens.get_common_prefix(input_tokens)", in_llmkit="common_prefix(self.cache_tokens, tokens)"),
    Counterpart("llmkit.engine.engine.Engine.step", "server_queue::start_loop", QUEUE,
                "one turn of its loop (new tasks, then update_slots), callable by hand on an engine made with start=False",
                in_upstream="callback_update_slots();", in_llmkit="self.update_slots()"),
    Counterpart("llmkit.engine.engine.Engine.update_slots", "server_context_impl::update_slots", CONTEXT,
                "one llama_decode per step, planned, then committed to the slots only once it succeeded; "
                "llama-server splits a batch larger than n_batch and retries smaller ones",
                in_upstream="pre_decode();", in_llmkit="self.scheduler.plan("),
    Counterpart("llmkit.engine.scheduler.build_batch", "server_context_impl::pre_decode", CONTEXT,
                "the batch building only; pre_decode also shifts context (Slot.shift_context), saves checkpoints, drafts",
                in_upstream="batch.size() < n_batch", in_llmkit="job.prompt_left[:room]"),
    Counterpart("llmkit.engine.engine.Engine.sample", "server_context_impl::post_decode", CONTEXT,
                "sampling each slot that asked for logits; a slot with a draft is verified in the same method "
                "(llama-server: a second loop over the slots, common_sampler_sample_and_accept_n)",
                in_upstream="common_sampler_sample(slot.smpl.get()", in_llmkit="job.sample(self.ctx"),
    # speculative decoding without a draft model (--spec-type ngram-simple | ngram-mod): draft, verify, accept
    Counterpart("llmkit.engine.engine.Engine.propose_drafts", "server_context_impl::pre_decode", CONTEXT,
                "the same bound on a draft (the slot's context, max_tokens), and also the stream's share of the batch; "
                "both draft on the loop's thread, in the step (llama-server inside yield_to_queue, its worker taking queued "
                "tasks meanwhile)",
                in_upstream="slot.get_n_draft_max()", in_llmkit="self.drafter.draft(slot.id"),
    Counterpart("llmkit.engine.engine.Engine.propose_drafts", "common_speculative_draft", "common/speculative.cpp",
                "one drafter, the engine's --spec-type; llama-server can chain several, each asked for the slots still without a draft",
                in_upstream="impl->draft(dparams)", in_llmkit="self.drafter.draft(slot.id"),
    Counterpart("llmkit.engine.engine.Engine.sample", "common_sampler_sample_and_accept_n", "common/sampling.cpp",
                "the same loop: sample at each row of the draft, stop at the first token that differs or at an end of generation",
                in_upstream="draft[i] != id", in_llmkit="token != draft[k]"),
    Counterpart("llmkit.engine.engine.Engine.accept_draft", "server_context_impl::post_decode", CONTEXT,
                "keep_first and seq_rm in one Slot.truncate; no checkpoint to restore (llmkit speculates only where "
                "the KV cache can drop cells)",
                in_upstream="slot.mem.seq_rm(slot.id, slot.prompt.tokens.pos_next(), -1)", in_llmkit="slot.truncate(self.ctx"),
    Counterpart("llmkit.engine.slot.Slot.truncate", "server_tokens::keep_first", COMMON,
                "the slot's token list cut, and its KV cells too (seq_rm): llama-server calls the two apart; no image chunks",
                in_upstream="tokens.resize(n)", in_llmkit="del self.cache_tokens[n:]"),
    Counterpart("llmkit.engine.speculative.NgramSimple.draft", "common_ngram_simple_draft", "common/ngram-map.cpp",
                "the same rule; the backward search is a byte search at C speed (rfind) that keeps only token-aligned hits",
                in_upstream="pattern.push_back(sampled)", in_llmkit="pattern = [*tokens[len(tokens) - n + 1 :], last]"),
    Counterpart("llmkit.engine.speculative.NgramMod", "common_ngram_mod", "common/ngram-mod.h",
                "the same table (4 Mi entries, a collision overwrites), in a numpy array; the per-slot state of "
                "common_speculative_impl_ngram_mod in the same class",
                in_upstream="std::vector<entry_t> entries", in_llmkit="self.entries = np.full(self.SIZE, self.EMPTY"),
    Counterpart("llmkit.engine.speculative.NgramMod.index", "common_ngram_mod::idx", "common/ngram-mod.cpp",
                "the same hash, kept to 64 bits by a mask",
                in_upstream="res*6364136223846793005ULL + tokens[i]", in_llmkit="h * 6364136223846793005 + token"),
    Counterpart("llmkit.engine.speculative.NgramMod.begin", "common_speculative_impl_ngram_mod::begin", "common/speculative.cpp",
                "the same: learn the prompt, empty the table once a quarter of it is used",
                in_upstream="mod.add(prompt.data() + i)", in_llmkit="self.learn(prompt, 0)"),
    Counterpart("llmkit.engine.speculative.NgramMod.draft", "common_speculative_impl_ngram_mod::draft_one", "common/speculative.cpp",
                "the same: learn the slot's new tokens 32 at a time, then follow the chain of lookups from its last tokens",
                in_upstream="mod.get(result.data() + i)", in_llmkit="self.entries[self.index(chain[-n:])]"),
    Counterpart("llmkit.engine.speculative.NgramMod.accept", "common_speculative_impl_ngram_mod::accept", "common/speculative.cpp",
                "the same rule (5 drafts in a row under a quarter accepted empty the table); llmkit then also forgets "
                "where every slot's tokens were learned up to, and counts the share accepted of the draft it verified, where "
                "llama-server divides by the chain's length before the request's caps cut it (n_draft_last)",
                in_upstream="sinfo.n_low >= 5", in_llmkit="self.n_low[seq] >= 5"),
    Counterpart("llmkit.engine.engine.Engine.process_token", "server_context_impl::process_token", CONTEXT,
                "the same checks (end of generation, stop strings, budget, context end); the last three in Engine.check_end",
                in_upstream="llama_vocab_is_eog(vocab, result.tok)", in_llmkit="self.model.is_eog(token)"),
    Counterpart("llmkit.engine.engine.Engine.deliver", "server_context_impl::send_partial_response", CONTEXT,
                "hands text and its tokens to the request's queue; the HTTP layer formats it",
                in_upstream="res->content = tkn.text_to_send", in_llmkit="job.request.emit("),
    Counterpart("llmkit.engine.engine.Engine.finish", "server_context_impl::send_final_response", CONTEXT,
                "writes the request's Outcome once (ending, counts, timings); also records the counters and frees the slot",
                in_upstream="= slot.stop;", in_llmkit="self.scheduler.end(job.request, outcome, slot)"),
    Counterpart("llmkit.engine.engine.Engine.fail", "server_context_impl::send_error", CONTEXT,
                "also frees the slot; the HTTP layer shapes the error for its API",
                in_upstream="server_task_result_error", in_llmkit="self.scheduler.end(job.request, error, slot"),
    Counterpart("llmkit.engine.slot.Slot", "server_slot", CONTEXT,
                "the KV sequence half: its id, cached tokens, last use; no LoRA, drafts or checkpoints",
                in_upstream="server_prompt prompt;", in_llmkit="self.cache_tokens"),
    Counterpart("llmkit.engine.job.Job", "server_slot", CONTEXT,
                "the running-task half (task, sampler, decoded tokens, held-back text, timings); it does not point at its slot, "
                "so a preempted job can go on in another",
                in_upstream="common_sampler_ptr smpl;", in_llmkit="sampler: Sampler"),
    Counterpart("llmkit.engine.request.RequestParams", "task_params", "tools/server/server-task.h",
                "the fields llmkit reads, sampling nested as there (SamplingParams ~ common_params_sampling)",
                in_upstream="struct common_params_sampling sampling;", in_llmkit="sampling: SamplingParams"),
    Counterpart("llmkit.server.protocol.params_from_body", "eval_llama_cmpl_schema", "tools/server/server-schema.cpp",
                "a request body (already validated by pydantic) onto the server's defaults; constraints compiled by the caller",
                in_upstream="params_base.sampling", in_llmkit="defaults.sampling"),
    Counterpart("llmkit.server.protocol.GenerationRequest.settings", "server_schema::make_llama_cmpl_schema",
                "tools/server/server-schema.cpp",
                "the fields named like the engine's are read by that name (the dataclasses' fields), the few others listed; "
                "tests/test_options.py checks that no body field is left unread",
                in_upstream='->add_alias("max_tokens")', in_llmkit="self.model_fields_set & BY_NAME"),
    Counterpart("llmkit.engine.request.RequestParams.to_dict", "task_params::to_json", TASK,
                "llama-server's keys that llmkit has, in its order (TO_JSON), then llmkit's own; one serializer for /props, /slots "
                "and generation_settings",
                in_upstream="common_grammar_value(sampling.grammar)", in_llmkit="s.grammar.text if isinstance(s.grammar, Grammar)"),
    Counterpart("llmkit.engine.request.End", "stop_type", "tools/server/server-task.h",
                "plain members, which each API names in its own table (openai.FINISH_REASON, native.STOP_TYPE ...); cancelled is a member "
                "(llama-server just drops the task)",
                in_upstream="STOP_TYPE_WORD", in_llmkit="WORD = enum.auto()"),
    Counterpart("llmkit.engine.slot.Slot.release", "server_slot::release", CONTEXT,
                "the same: the KV cache stays for the next request",
                in_upstream="t_last_used = ggml_time_us()", in_llmkit="self.t_last_used = time.perf_counter()"),
    Counterpart("llmkit.engine.tokens.common_prefix", "server_tokens::get_common_prefix", COMMON,
                "plain token lists (no multimodal chunks), compared by halves (list equality runs in C), then a loop",
                in_upstream="tokens[i] == b.tokens[i]", in_llmkit="a[lo] == b[lo]"),
    Counterpart("llmkit.engine.request.Request", "server_task", "tools/server/server-task.h",
                "one object for the task and its results (llama-server: a task, then results through server_response)",
                in_upstream="server_tokens tokens;", in_llmkit="self.prompt = prompt"),
    Counterpart("llmkit.engine.request.Request.cancel", "server_response_reader::stop", QUEUE,
                "sets a flag the engine reads at its next step; llama-server posts a cancel task to the queue's front",
                in_upstream="SERVER_TASK_TYPE_CANCEL", in_llmkit="self._cancelled.set()"),
    Counterpart("llmkit.engine.status.Counters", "server_metrics", "tools/server/server-common.h",
                "totals since start only (no per-bucket values), plus step and decode seconds",
                in_upstream="n_busy_slots", in_llmkit="n_busy_slots_total"),
    Counterpart("llmkit.text.StopMatcher", "server_slot::find_stopping_strings", CONTEXT,
                "holds back a partial match the same way",
                in_upstream="string_find_partial_stop(text, word)", in_llmkit="self._partial_len(s)"),
    Counterpart("llmkit.text.Detokenizer", "validate_utf8", COMMON,
                "holds back an incomplete UTF-8 character the same way",
                in_upstream="(c & 0xE0) == 0xC0", in_llmkit='getincrementaldecoder("utf-8")'),
    Counterpart("llmkit.server.app.create_app", "server_routes::init_routes", CONTEXT,
                "FastAPI routes; llama-server registers its handlers on cpp-httplib in llama_server() (server.cpp)",
                in_upstream="this->post_chat_completions", in_llmkit="app.include_router(router)"),
    Counterpart("llmkit.server.dialects.openai_chat.chat_completions", "server_routes::post_chat_completions", CONTEXT,
                "the chat template applied by the model layer, tools described as tools.ToolCalling says; no multimodal parts",
                in_upstream="TASK_RESPONSE_TYPE_OAI_CHAT", in_llmkit="openai_formatter(ChatFormatter, state, body)"),
    Counterpart("llmkit.server.dialects.openai_text.completions", "server_routes::post_completions_oai", CONTEXT,
                "the same prompt shapes, one prompt (no n > 1)",
                in_upstream="TASK_RESPONSE_TYPE_OAI_CMPL", in_llmkit="openai_formatter(TextFormatter, state, body)"),
    Counterpart("llmkit.server.generation.generate", "server_routes::handle_completions_impl", CONTEXT,
                "submit, then answer: a stream's status line once the engine admits the request into a slot, at the start of a "
                "step (llama-server: on its begin result, in a step whose batch still has room); one engine request per "
                "prompt (no n > 1), streamed through Starlette",
                in_upstream="rd.post_tasks(std::move(tasks))", in_llmkit="await submit("),
    Counterpart("llmkit.server.dialects.native.completion", "server_routes::post_completions", CONTEXT,
                "llama-server's own dialect on /completion and /completions: several prompts are streamed one after the other, not "
                "interleaved",
                in_upstream="TASK_RESPONSE_TYPE_NONE", in_llmkit="NativeFormatter("),
    Counterpart("llmkit.server.dialects.native.tokenize_mixed", "tokenize_mixed", COMMON, "the same rule: BOS only before a leading string",
                in_upstream="common_tokenize(vocab, s, false, parse_special)", in_llmkit="add_special=i == 0"),
    Counterpart("llmkit.server.dialects.native._native_prompts", "tokenize_input_prompts", COMMON,
                "the same shapes; a list of prompts is several completions, at most 64",
                in_upstream="json_is_array_and_contains_numbers(json_prompt)", in_llmkit="any(map(_is_token, p))"),
    Counterpart("llmkit.server.info.apply_template", "server_routes::post_apply_template", CONTEXT, "the same",
                in_upstream='data.at("prompt")', in_llmkit='"prompt": await off_loop(render_chat'),
    Counterpart("llmkit.server.embeddings.embeddings_native", "server_routes::handle_embeddings_impl", CONTEXT,
                "no --embeddings mode needed: a second context pools beside generation",
                in_upstream="SERVER_TASK_TYPE_EMBEDDING", in_llmkit="await embed(body"),
    Counterpart("llmkit.server.errors.TYPES", "error_type", "tools/server/server-common.h", "the same names, chosen by status",
                in_upstream="ERROR_TYPE_NOT_SUPPORTED", in_llmkit='501: "not_supported_error"'),
    Counterpart("llmkit.server.errors.Dialect", "format_error_response", COMMON,
                "the same shape; invalid JSON is a 400 here, a 500 there; Anthropic's routes answer in Anthropic's shape (the router "
                "declares it)",
                in_upstream='{"code", code}', in_llmkit='{"code": exc.status'),
    Counterpart("llmkit.server.sse.event", "format_oai_sse", COMMON, "the same bytes: data: <json>, a blank line",
                in_upstream='"data: "', in_llmkit='f"data: '),
    Counterpart("llmkit.server.dialects.openai.OpenAIFormatter", "server_task_result_cmpl_partial", "tools/server/server-task.h",
                "one formatter for chat and text completions, whole and streamed; ChatFormatter and TextFormatter fill in what differs",
                in_upstream="oaicompat_msg_diffs", in_llmkit="deltas: list[Delta]"),
    Counterpart("llmkit.server.dialects.openai.OpenAIFormatter.chunk", "server_task_result_cmpl_partial::to_json_oaicompat_chat", TASK,
                "one chunk per text piece (held-back tokens wait for their text)",
                in_upstream='last_json.at("choices").at(0)["logprobs"]', in_llmkit='chunks[-1]["choices"][0]["logprobs"]'),
    Counterpart("llmkit.server.dialects.openai.OpenAIFormatter.response", "server_task_result_cmpl_final::to_json_oaicompat", TASK,
                "the same envelope; chat and text completions share it",
                in_upstream="usage_json_oaicompat()", in_llmkit="usage=usage(outcome)"),
    Counterpart("llmkit.server.dialects.openai.usage", "server_task_result_cmpl_final::usage_json_oaicompat", TASK, "the same",
                in_upstream='{"cached_tokens", n_prompt_tokens_cache}', in_llmkit='{"cached_tokens": outcome.n_cached}'),
    Counterpart("llmkit.server.dialects.native.NativeFormatter.final", "server_task_result_cmpl_final::to_json_non_oaicompat", TASK,
                "the same keys in the same order, where llmkit has the value",
                in_upstream='"tokens_cached"', in_llmkit='"tokens_cached": outcome.tokens_cached'),
    Counterpart("llmkit.server.dialects.native.NativeFormatter.chunk", "server_task_result_cmpl_partial::to_json_non_oaicompat", TASK,
                "one chunk per text piece; no timings in chunks",
                in_upstream="probs_vector_to_json({prob_output}", in_llmkit="token_logprobs(piece.logprobs"),
    Counterpart("llmkit.server.dialects.openai.token_logprobs", "completion_token_output::probs_vector_to_json", TASK,
                "OpenAI's logprobs shape; the native one for /completion",
                in_upstream="str_to_bytes(p.text_to_send)", in_llmkit='"bytes": list(raw)'),
    Counterpart("llmkit.server.metrics.render", "server_task_result_metrics::to_metrics", TASK,
                "prometheus_client writes the text (llama-server writes it by hand)",
                in_upstream='"# HELP llamacpp:"', in_llmkit="generate_latest(reg)"),
    Counterpart("llmkit.server.generation.submit", "server_response_reader::post_tasks", QUEUE,
                "the request's settings checked and compiled off the event loop, then one prompt queued",
                in_upstream="queue_tasks.post(std::move(tasks)", in_llmkit="engine.submit(prompt, params, kv)"),
    Counterpart("llmkit.server.generation.collect", "server_response_reader::wait_for_all", QUEUE,
                "also watches the connection: ASGI reports the closed socket at once and the request is cancelled; llama-server's "
                "next polls should_stop (a peek at the socket) only when its 1-second wait for a result times out, and every "
                "other request's result starts that wait again: beside a running stream, an abandoned answer is generated to "
                "its end (chapter 3)",
                in_upstream="next(should_stop)", in_llmkit="async for piece in request"),
    Counterpart("llmkit.server.protocol.ChatRequest.tool_calling", "oaicompat_chat_params_parse", COMMON,
                "tools, tool_choice and parallel_tool_calls checked (parallel by default only where the template can); a constraint with "
                "tools is a 400 (llama-server: grammar only)",
                in_upstream='caps["supports_parallel_tool_calls"]', in_llmkit="native if self.parallel_tool_calls is None"),
    Counterpart("llmkit.server.tools.ToolCalling", "common_chat_templates_apply_jinja", "common/chat.cpp",
                "one format for every model (Hermes 2 Pro's <tool_call>), described in the prompt when the template cannot; llama.cpp "
                "derives the format from each template and ignores tools where it has none",
                in_upstream="common_chat_tools_to_json_oaicompat(inputs.tools)", in_llmkit="t.to_openai() for t in self.tools"),
    Counterpart("llmkit.server.tools.CallParser", "common_chat_parse", "common/chat.cpp",
                "reads that one format piece by piece; llama.cpp parses the whole message again at each token and diffs it",
                in_upstream="input, is_partial", in_llmkit="def push(self, text: str) -> list[Delta]"),
    Counterpart("llmkit.server.tools.Delta", "common_chat_msg_diff", "common/chat.h",
                "content, or a call's start or a piece of its arguments; no reasoning",
                in_upstream="tool_call_index = std::string::npos", in_llmkit="index: int = -1"),
    Counterpart("llmkit.grammar.sampler.Trigger", "llama_grammar_accept_impl", "src/llama-grammar.cpp",
                "its lazy-grammar branch, with one word that must end on a token boundary; llama.cpp takes regex patterns and replays "
                "the rest of the token into the grammar, which throws if it does not fit: llama-server fails that request (500), "
                "a caller of the C API, as llmkit is, aborts (chapter 6)",
                in_upstream="grammar.awaiting_trigger", in_llmkit="self.fired"),
    Counterpart("llmkit.server.dialects.native.pick", "json_get_nested_values", COMMON,
                "the same: response_fields by slash path, each kept under its path, one that leads nowhere left out",
                in_upstream="valid_path = false", in_llmkit='path.split("/")'),
    Counterpart("llmkit.server.sse.named_event", "format_anthropic_sse", COMMON,
                "the same bytes: event: <type>, data: <json>, a blank line",
                in_upstream='"event: "', in_llmkit='f"event: '),
    Counterpart("llmkit.server.dialects.openai_chat.ChatFormatter.delta", "server_chat_msg_diff_to_json_oaicompat",
                "tools/server/server-chat.cpp",
                "the same delta shapes, one chunk per delta",
                in_upstream='delta["tool_calls"]', in_llmkit='"tool_calls": [call]'),
    Counterpart("llmkit.server.dialects.responses.responses", "server_routes::post_responses_oai", CONTEXT,
                "the same path: convert to chat, answer, write a Response",
                in_upstream="server_chat_convert_responses_to_chatcmpl(", in_llmkit="body.to_chat"),
    Counterpart("llmkit.server.dialects.responses.input_tokens", "server_routes::handle_count_tokens", CONTEXT,
                "the same count: the chat prompt, tools included",
                in_upstream='response["object"] = "response.input_tokens"', in_llmkit='"object": "response.input_tokens"'),
    Counterpart("llmkit.server.dialects.responses.InputRequest.to_chat", "server_chat_convert_responses_to_chatcmpl",
                "tools/server/server-chat.cpp",
                "the same conversion; also text.format (llama-server ignores it); images, files and hosted tools are a 400 (llama-server "
                "skips hosted tools)",
                in_upstream='chatcmpl_body["messages"] = chatcmpl_messages', in_llmkit='"messages": self.chat_messages()'),
    Counterpart("llmkit.server.dialects.responses.ResponsesFormatter.response", "server_task_result_cmpl_final::to_json_oaicompat_resp",
                TASK,
                "OpenAI's whole Response (status incomplete when max_output_tokens cut it; llama-server always says completed, and "
                "writes fewer fields)",
                in_upstream='"function_call"', in_llmkit="self.call_item(c.id"),
    Counterpart("llmkit.server.dialects.responses.ResponsesFormatter.wrote", "server_task_result_cmpl_partial::to_json_oaicompat_resp",
                TASK,
                "the same events, with OpenAI's sequence_number, output_index and content_index; each item is closed (.done) when the "
                "next opens",
                in_upstream='"response.output_text.delta"', in_llmkit='"output_text.delta"'),
    Counterpart("llmkit.server.dialects.messages.messages", "server_routes::post_anthropic_messages", CONTEXT,
                "the same path: convert to chat, answer, write a message; errors in Anthropic's shape",
                in_upstream="server_chat_convert_anthropic_to_oai(", in_llmkit="body.to_chat"),
    Counterpart("llmkit.server.dialects.messages.count_tokens", "server_routes::handle_count_tokens", CONTEXT,
                "the same count: the chat prompt, tools included",
                in_upstream='{"input_tokens", static_cast<int64_t>(n_tokens)}', in_llmkit='{"input_tokens": len(prompt)}'),
    Counterpart("llmkit.server.dialects.messages.CountTokensRequest.to_chat", "server_chat_convert_anthropic_to_oai",
                "tools/server/server-chat.cpp",
                "the same conversion, but max_tokens is required, a named tool stays named, images are a 400 (llama-server: 500), an "
                "error result says so",
                in_upstream='{"role", "system"}', in_llmkit='{"role": "system", "content": self.system_text()}'),
    Counterpart("llmkit.server.dialects.messages.MessagesFormatter.response", "server_task_result_cmpl_final::to_json_anthropic", TASK,
                "the same message; stop_sequence is a stop_reason of its own (llama-server says end_turn)",
                in_upstream='{"stop_reason", stop_reason}', in_llmkit="stop_reason(outcome, len(answer.calls))"),
    Counterpart("llmkit.server.dialects.messages.MessagesFormatter.wrote", "server_task_result_cmpl_partial::to_json_anthropic", TASK,
                "the same block events; a ping follows message_start, as Anthropic's",
                in_upstream='"input_json_delta"', in_llmkit='"partial_json": delta.arguments'),
    Counterpart("llmkit.server.dialects.blocks.Blocks", "task_result_state", "tools/server/server-task.h",
                "one open block and its kind, for Responses and Messages alike; llama-server keeps a started flag per kind of block",
                in_upstream="bool text_block_started", in_llmkit="kind: Kind | None"),
    Counterpart("llmkit.server.embeddings.Embedder", "server_context_impl::send_embedding", CONTEXT,
                "a second, small context for embeddings instead of a slot in the main one",
                in_upstream="llama_get_embeddings_seq(", in_llmkit="self._ctx.embedding(0)"),
    # Beyond one machine (chapter 10): what llama-server has beside llmkit's fleet, its worker routes and its hand-off
    Counterpart("llmkit.course.fleet.start_replicas", "server_models::load", MODELS,
                "starts N replicas of one model at once, each on a free port, for a real router in front of them (vllm-router); "
                "llama-server's router mode spawns one child per model a request names, when it is named, and proxies to it itself",
                in_upstream="common_http_get_free_port()", in_llmkit="launch.spawn(server"),
    Counterpart("llmkit.course.fleet.Fleet.stop", "server_models::unload_all", MODELS,
                "the router first, then every replica at once (SIGTERM, then SIGKILL after 15 s); llama-server asks each child to exit",
                in_upstream="request_stop(name, !loading)", in_llmkit="stop_all(self.replicas)"),
    Counterpart("llmkit.server.worker.render_chat", "server_routes::post_apply_template", CONTEXT,
                "the chat's prompt as token ids (vLLM's render route, which vllm-router's prefix-aware policies ask of every worker); "
                "llama-server's /apply-template answers the prompt as text, and has no render route",
                in_upstream="oaicompat_chat_params_parse(", in_llmkit="chat_prompt, state.engine.model, body"),
    Counterpart("llmkit.server.handoff.kv_handoff", "server_context_impl::process_single_task", CONTEXT,
                "a finished prefill's KV cells for its decode worker, over HTTP, once (kept 60 s in RAM); llama-server's slot save "
                "(/slots?action=save) writes a slot's cells to a file under --slot-save-path",
                in_upstream="llama_state_seq_save_file(", in_llmkit="kept.take(key)"),
    Counterpart("llmkit.engine.scheduler.Scheduler.launch_from", "server_context_impl::process_single_task", CONTEXT,
                "starts a request from KV cells another server read (disaggregated decode); llama-server's slot restore loads an idle "
                "slot's cells from a file, with no request",
                in_upstream="llama_state_seq_load_file(", in_llmkit="slot.load_cells(self.memory"),
)  # fmt: skip


def counterparts(llmkit_path: str) -> list[Counterpart]:
    """The rows for one llmkit symbol."""
    return [row for row in MAP if row.llmkit == llmkit_path]


def llmkit_symbol(path: str) -> Symbol:
    """llmkit's code at ``path`` as a ``Symbol`` (file, lines, text), to show beside the C++."""
    obj, nested = _locate(path)
    if not (inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj)):
        return _constant(path)
    lines, first = inspect.getsourcelines(obj)
    first = max(first, 1)  # a module starts at 0
    file = _source_file(obj)
    if nested:  # a function inside a function: its lines within the outer one
        node = _nested(obj, nested, path)
        top = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        start, end = first + top - 1, first + (node.end_lineno or node.lineno) - 1
        kind = "function"
    else:
        start, end = first, first + len(lines) - 1
        kind = "module" if inspect.ismodule(obj) else "class" if inspect.isclass(obj) else "function"
    text = "\n".join(file.read_text().splitlines()[start - 1 : end])
    relative = file.resolve().relative_to(ROOT).as_posix()
    return Symbol(path, kind, relative, start, end, text, language="python")


def _constant(path: str) -> Symbol:
    """A module-level constant (a table, say): the lines of its assignment."""
    module_path, name = path.rsplit(".", 1)
    module = importlib.import_module(module_path)
    file = _source_file(module)
    text = file.read_text()
    node = next(
        n
        for n in ast.parse(text).body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        and name in [t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)]
    )
    end = node.end_lineno or node.lineno
    lines = "\n".join(text.splitlines()[node.lineno - 1 : end])
    relative = file.resolve().relative_to(ROOT).as_posix()
    return Symbol(path, "constant", relative, node.lineno, end, lines, language="python")


def _source_file(obj: Any) -> Path:
    """The file an llmkit module, class or function is defined in (every one has a file)."""
    file = inspect.getsourcefile(obj)
    if file is None:
        raise LookupError(f"{obj!r} has no source file")
    return Path(file)


def resolve(path: str) -> object:
    """The llmkit object at ``path``: imported, or for a nested function its ``ast`` node."""
    obj, nested = _locate(path)
    return _nested(obj, nested, path) if nested else obj


def _locate(path: str) -> tuple[object, list[str]]:
    """The deepest importable object on ``path`` and the names left (functions nested in it)."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        rest = parts[split:]
        while rest and hasattr(obj, rest[0]):
            obj = getattr(obj, rest.pop(0))
        if rest and not (inspect.isfunction(obj) or inspect.isclass(obj)):
            raise LookupError(f"{path}: {'.'.join(parts[: len(parts) - len(rest)])} has no {rest[0]}")
        return obj, rest
    raise LookupError(f"no module for {path}")


Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _nested(outer: Any, names: list[str], path: str) -> Definition:
    node: ast.stmt = ast.parse(inspect.getsource(outer)).body[0]
    for name in names:
        defs = [n for n in ast.walk(node) if isinstance(n, Definition) and n.name == name]
        if not defs:
            raise LookupError(f"{path}: no {name} inside")
        node = defs[0]
    assert isinstance(node, Definition), f"{path}: not a function or class"
    return node
