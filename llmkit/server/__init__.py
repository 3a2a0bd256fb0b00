"""The slot server's HTTP layer: an OpenAI-compatible API plus llama-server's extras.

Module map (llama-server's tools/server/ files in brackets):

    app         routes and the generation path                 [server.cpp + server-context.cpp handlers]
    protocol    request models, validation, SamplingParams      [server-schema.cpp + server-common.cpp]
    sse         response, chunk and SSE formatting              [server-task.cpp to_json_oaicompat*, to_json_non_oaicompat]
    errors      the error shape and every exception handler     [server-common.cpp format_error_response]
    middleware  loading / API-key / body-size gate, request log [server-http.cpp]
    metrics     Prometheus text from the engine's counters      [server-task.cpp to_metrics]
    embeddings  pooled, normalised vectors in their own context [server-context.cpp send_embedding]

    app = create_app(engine_or_loader, Settings(alias="smollm2"))
"""

from llmkit.server.app import Settings, create_app

__all__ = ["Settings", "create_app"]
