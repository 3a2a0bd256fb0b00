"""The slot server's HTTP layer: an OpenAI-compatible API plus llama-server's extras.

Module map (llama-server's tools/server/ files in brackets):

    app         create_app: state, middlewares, handlers and routes wired  [server.cpp route table, init_routes]
    state       Settings, the engine as the routes see it (a Protocol)     [what server-context.cpp's handlers use]
    generation  chat, text and native completion routes; ``generate``      [server-context.cpp handle_completions_impl]
    embeddings  pooled, normalised vectors in their own context; routes    [server-context.cpp send_embedding]
    info        health, models, props, slots, metrics, tokenize routes     [server-context.cpp handlers]
    protocol    request models, validation, SamplingParams                 [server-schema.cpp + server-common.cpp]
    sse         response, chunk and SSE formatting                         [server-task.cpp to_json_oaicompat*, to_json_non_oaicompat]
    errors      the error shape, every exception handler, ``off_loop``     [server-common.cpp format_error_response]
    middleware  loading / API-key / body-size gate, request log            [server-http.cpp]
    metrics     Prometheus text from the engine's counters                 [server-task.cpp to_metrics]
    kv_publisher  KV events over ZMQ and where they are, for kv_aware routing  [none: vLLM's ZmqEventPublisher]
    handoff     disaggregated prefill and decode: KV cells between workers [none: vLLM's kv_transfer_params]

    app = create_app(engine_or_loader, Settings(alias="smollm2"))
"""

from llmkit.server.app import Settings, create_app

__all__ = ["Settings", "create_app"]
