"""The slot server's HTTP layer: the OpenAI, Responses and Messages APIs and llama-server's own, over one engine.

Module map (llama-server's tools/server/ files in brackets):

    app          create_app: the features built and started; routes wired        [server.cpp route table, init_routes]
    state        Settings, the engine as the routes see it (a Protocol), State    [what server-context.cpp's handlers use]
    dialects/    one module per API: body, conversion, wire format, router        [server-chat.cpp, server-task.cpp to_json_*]
    generation   the one request path: chat, generate, submit, answer_one         [server-context.cpp handle_completions_impl]
    protocol     the shared request fields and chat request; options -> engine    [server-schema.cpp + server-common.cpp]
    tools        tool calls: described in the prompt, constrained, parsed back    [common/chat.cpp]
    sse          SSE framing (data-only and named events) and the WireFormat      [server-common.cpp format_oai_sse]
    errors       each dialect's error shape, every exception handler, off_loop    [server-common.cpp format_error_response]
    embeddings   pooled, normalised vectors in their own context; routes          [server-context.cpp send_embedding]
    info         health, models, props, slots, metrics, tokenize routes           [server-context.cpp handlers]
    middleware   loading / API-key / body-size gate, request log                  [server-http.cpp]
    worker       what a router asks first: a chat's token ids (render)             [vLLM's render contract; none in llama-server]
    metrics      Prometheus text from the engine's counters                       [server-task.cpp to_metrics]
    kv_publisher  the KV events over ZMQ and where they are, for kv_aware routing [none: vLLM's ZmqEventPublisher]
    handoff      disaggregated prefill and decode: KV cells from worker to worker  [none: vLLM's kv_transfer_params]

    app = create_app(engine_or_loader, Settings(alias="smollm2"))
"""

from llmkit.server.app import Settings, create_app

__all__ = ["Settings", "create_app"]
