"""llmkit: a course kit that builds a production-shaped LLM server beside a simple one.

Map of the package (each module one role, named after llama-server's files):

    models      where a model comes from: the embedded default, a path, the catalog + download
    llama       thin typed layer over llama-cpp-python's low-level API
    text        incremental UTF-8 detokenizer and stop-string matcher
    grammar/    structured output for the server: JSON Schema -> GBNF, checked, parsed once per model
    sequential/ the tutorial's translation server (one request at a time)
    engine/     the slot engine: continuous batching, prefix reuse (~ server-context.cpp)
    server/     the slot server's OpenAI-compatible HTTP layer (~ server.cpp, server-http.cpp)
    launch      start/stop servers in the background (notebooks, tests, bench)
    bench       the servers side by side over HTTP
    cli         `llmkit serve | translate | bench`
"""

__version__ = "0.1.0"
