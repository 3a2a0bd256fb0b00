"""llmkit: a course kit that builds a production-shaped LLM server beside a simple one.

Map of the package (each module one role, named after llama-server's files). The runtime, what the servers run:

    models      where a model comes from: the embedded default, a path, the catalog + download
    llama       thin typed layer over llama-cpp-python's low-level API
    sampling    the sampler chain that picks the next token (llama-server's defaults)
    text        incremental UTF-8 detokenizer and stop-string matcher
    timings     llama-server's per-request timings, which both servers report
    grammar/    structured output for the server: JSON Schema -> GBNF, checked, parsed once per model
    sequential/ the tutorial's translation server (one request at a time)
    engine/     the slot engine: continuous batching, prefix reuse (~ server-context.cpp)
    server/     the slot server's OpenAI-compatible HTTP layer (~ server.cpp, server-http.cpp)
    cli/        `llmkit serve | translate` (serve), `bench | upstream | fleet | sim | exercises` (course)

The course's apparatus, apart from it (the `lab` extra; no server imports it):

    course/     the course's apparatus; its face names words' tr, pad, table, large_number
      words       tr, pad, table, large_number: the notebooks' printed words in the reader's language
      upstream/   the real llama-server: its C++ read by name, MAP (llmkit <-> llama-server), its build
      bench/      `llmkit bench`: the servers side by side over HTTP
      launch      start/stop servers in the background (notebooks, tests, bench)
      fleet       replicas behind a real router (vllm-router), in one line; a replica killed and restarted
      trace       a multi-tenant chat trace (seeded), its replay over HTTP, what it measured
      sim/        `llmkit sim`: the fleet in a discrete-event model (simpy), calibrated from the engine's step costs;
                  checked against real fleets; replicas for a TTFT SLO at scale, per policy, CPU and GPU-like costs
      client      HTTP helpers: stream from either server and time every piece
      widgets     ipywidgets: a translator that streams into the page
      exercises/  checks that answer back (ex.q1.check), hints, progress; a student edition, a class graded

README.md's "Layout" lists the same rooms (tests/test_layout.py checks both against the files).
"""

__version__ = "0.1.0"
