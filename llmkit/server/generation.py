"""The one request path of every generation dialect (~ llama-server's handle_completions_impl in
server-context.cpp): ``generate`` submits a prompt to the engine, reads the text as content and tool calls
(``tools``), then answers whole or streams, in the dialect's ``sse.WireFormat``. ``chat`` is the chat
dialects' way in (OpenAI chat, and Responses and Messages once converted): the chat template renders the
prompt, tools included.

    dialect route -> [to_chat ->] chat -> generate -> submit (engine.submit) -> answer_one (whole, or stream)

The routes are each dialect's own (``server/dialects/``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from llmkit import grammar
from llmkit.engine import ContextSizeError, KVState, Outcome, Piece, RequestParams
from llmkit.engine import Request as EngineRequest
from llmkit.llama import Model
from llmkit.server import handoff, sse
from llmkit.server.errors import ApiError, off_loop
from llmkit.server.middleware import log_usage
from llmkit.server.protocol import ChatRequest, GenerationRequest, constraint_of, params_from_body
from llmkit.server.state import ServerState
from llmkit.server.tools import CallParser, TextParser, ToolCalling

log = logging.getLogger("llmkit.server")

Reader = TextParser | CallParser  # reads an answer's text as content (and tool calls)


async def chat(http_request: Request, state: ServerState, body: ChatRequest, fmt: sse.WireFormat) -> Any:
    """A chat request, from any of the three chat APIs (the others convert theirs to this one)."""
    prompt, calling = await off_loop(chat_prompt, state.engine.model, body)
    return await generate(http_request, state, body, prompt, fmt, calling)


def chat_prompt(model: Model, body: ChatRequest) -> tuple[list[int], ToolCalling]:
    """The conversation rendered with ``model``'s chat template, tools described as they apply to it; and
    those tools (``ChatRequest.tool_calling``: a ValueError says what is wrong with them)."""
    calling = body.tool_calling(model.chat_template)
    messages, tools = calling.render([m.to_template() for m in body.messages])
    return model.tokenize_chat(messages, tools), calling


async def generate(
    http_request: Request,
    state: ServerState,
    body: GenerationRequest,
    prompt: list[int],
    fmt: sse.WireFormat,
    calling: ToolCalling | None = None,
) -> Any:
    """Submit the prompt; answer with the whole completion, or stream it. In a disaggregated pair (``handoff``), a
    decode worker starts from its prefill worker's KV cells, and a prefill worker's answer says where they are."""
    kv = await handoff.fetch(body, prompt, state.settings.pd_peers)
    request = await submit(http_request, state, body, prompt, calling, kv)
    answered = await answer_one(http_request, state, body, request, fmt, calling)
    return handoff.offer(http_request, prompt, request, answered) if handoff.hands_off(body) else answered


async def submit(
    http_request: Request,
    state: ServerState,
    body: GenerationRequest,
    prompt: list[int],
    calling: ToolCalling | None = None,
    kv: KVState | None = None,
) -> EngineRequest:
    """The request's settings checked and compiled, then its prompt queued (llama-server: post_tasks)."""
    engine = state.engine
    # the constraint's conversion and check are CPU work: off the event loop; bad ones are a 400 here
    params = await off_loop(request_params, body, state.settings.defaults, engine.model, calling)
    if tenant := http_request.headers.get("x-tenant"):  # who the request is for (--scheduling-policy fair-share)
        params = dataclasses.replace(params, tenant=tenant)
    try:
        return engine.submit(prompt, params, kv)
    except ContextSizeError:
        raise  # a 400 of its own shape (errors.install)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


async def answer_one(
    http_request: Request,
    state: ServerState,
    body: GenerationRequest,
    request: EngineRequest,
    fmt: sse.WireFormat,
    calling: ToolCalling | None = None,
) -> Any:
    """One request's answer (chat, Responses, Messages, one native prompt), whole or streamed, read as content and
    tool calls (``calling``'s parser, else the text as it is)."""
    reader = calling.parser() if calling is not None else TextParser()
    if not body.stream:
        return await answer_whole(http_request, request, fmt, reader)
    return await stream(http_request, state, body, [request], [fmt], [reader])


async def answer_many(
    http_request: Request, state: ServerState, body: GenerationRequest, requests: list[EngineRequest], formats: list[sse.WireFormat]
) -> Any:
    """Native ``/completion``'s prompts: one prompt's answer alone (as llama-server), several as a list of whole
    answers, or every stream one after the other in one response."""
    if len(requests) == 1:
        return await answer_one(http_request, state, body, requests[0], formats[0])
    readers: list[Reader] = [TextParser() for _ in requests]
    if not body.stream:
        return [await answer_whole(http_request, *answer) for answer in zip(requests, formats, readers, strict=True)]
    return await stream(http_request, state, body, requests, formats, readers)


async def stream(
    http_request: Request,
    state: ServerState,
    body: GenerationRequest,
    requests: list[EngineRequest],
    formats: list[sse.WireFormat],
    readers: list[Reader],
) -> StreamingResponse:
    """The answers streamed, one after the other.

    The status line goes out once a slot holds the (first) request, before its prompt is read, as
    llama-server sends it on its "begin" result: an error before that (the request failed to start) is an
    ordinary HTTP error, one after it comes inside the stream. A ping keeps a quiet stream alive (a long prompt).
    """
    await requests[0].started()
    silence = body.sse_ping_interval if body.sse_ping_interval is not None else state.settings.sse_ping_interval
    streams = [request.pieces(silence if silence > 0 else None) for request in requests]
    events = stream_events(http_request, list(zip(requests, formats, readers, streams, strict=True)))

    def cancel_all() -> None:
        for request in requests:
            request.cancel()

    # On a client disconnect Starlette cancels ``events`` and then runs the background
    # task: ``cancel`` frees the slots at the engine's next step (a no-op once finished).
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}, background=BackgroundTask(cancel_all)
    )


async def answer_whole(http_request: Request, request: EngineRequest, fmt: sse.WireFormat, reader: Reader) -> Any:
    """One request's whole answer, once it is done."""
    pieces = await collect(request, http_request)
    outcome = ended(request)
    log_usage(http_request, outcome.n_prompt, outcome.n_cached, outcome.n_output)
    for piece in pieces:
        reader.push(piece.text)
    reader.finish()
    return fmt.response(outcome, pieces, reader)


def ended(request: EngineRequest) -> Outcome:
    """The outcome of a request whose pieces were all read (a failed one raised its error instead)."""
    assert request.outcome is not None, "read to its end, a request has ended"
    return request.outcome


Stream = tuple[EngineRequest, sse.WireFormat, Reader, AsyncGenerator[Piece | None, None]]  # request, format, reader, pieces


async def stream_events(http_request: Request, streams: list[Stream]) -> AsyncIterator[str]:
    """Every request's frames, one request after the other: its opening with its first piece, a chunk per piece,
    its closing; then the format's end marker. An error after the 200 is reported in the stream, in the format's shape."""
    request, fmt = streams[0][0], streams[0][1]
    sent = dict.fromkeys((r.id for r, *_ in streams), 0)  # tokens each request's pieces carried to the client
    try:
        for request, fmt, reader, pieces in streams:
            opening = fmt.opening(request)  # sent with the first piece, as llama-server's first partial result
            async for piece in pieces:
                if piece is None:
                    yield sse.PING
                    continue
                sent[request.id] += len(piece.tokens)
                for obj in [*opening, *fmt.chunk(request, piece, reader.push(piece.text))]:
                    yield fmt.frame(obj)
                opening = []
            held_back = reader.finish()  # text that could have begun a tool call, and did not
            last = fmt.chunk(request, Piece("", []), held_back) if held_back else []
            for obj in [*opening, *last, *fmt.closing(ended(request), reader)]:
                yield fmt.frame(obj)
        if streams[0][1].done:
            yield streams[0][1].done
    except Exception as exc:  # noqa: BLE001 -- the 200 is already sent: report in the stream, and end it
        log.warning("stream of request %d failed: %s", request.id, exc)
        for obj in fmt.error(ApiError(500, str(exc) or type(exc).__name__)):
            yield fmt.frame(obj)
    finally:
        for _, _, _, pieces in streams:
            await pieces.aclose()
        for request, *_ in streams:  # what each got to, whether the client stayed or not
            done = request.outcome
            n_output = done.n_output if done is not None else sent[request.id]  # a client that left: what it was sent
            log_usage(http_request, len(request.prompt), request.n_cached, n_output)


async def collect(request: EngineRequest, http_request: Request) -> list[Piece]:
    """Every piece of a whole (not streamed) answer, while watching the connection: a client that
    leaves cancels the request, and its slot is free at the engine's next step.

    Nothing is written to the socket until the answer is whole, so a closed connection shows only
    on the read side: after the body, the next ASGI ``receive`` returns ``http.disconnect`` when
    the client closes its socket (uvicorn sees the connection lost). llama-server checks its
    ``is_connection_closed`` only when its 1-second wait for a result times out, and every other
    request's result starts that wait again: beside a running stream, an abandoned whole answer
    is generated to its end there (chapter 3).
    """

    async def watch() -> None:
        while (await http_request.receive())["type"] != "http.disconnect":
            pass
        request.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return [piece async for piece in request]
    finally:
        watcher.cancel()


def request_params(body: GenerationRequest, defaults: RequestParams, model: Model, calling: ToolCalling | None = None) -> RequestParams:
    """The request's settings, with its constraint (if any) compiled into a grammar for ``model``'s slots:
    the tool-call grammar when a call may come, else its ``response_format``, ``json_schema`` or ``grammar``."""
    constraint = constraint_of(body)
    calls = calling.grammar() if calling is not None else None
    ignore_eos = body.ignore_eos if "ignore_eos" in body.model_fields_set else defaults.sampling.ignore_eos  # or --ignore-eos
    if ignore_eos and constraint is not None:
        raise ValueError(
            "'ignore_eos' cannot be used with a grammar or a schema: once the output is complete, the end is the only token left"
        )
    if calls is None:
        return params_from_body(body, defaults, None if constraint is None else grammar.compile(constraint, model))
    if constraint is not None:
        raise ValueError("Cannot use custom grammar constraints with tools.")  # llama-server's words (it checks 'grammar' only)
    if ignore_eos:
        raise ValueError("'ignore_eos' cannot be used with tools: after a call, the end is the only token left")
    text, trigger = calls
    if trigger is not None:
        model.word_masks(trigger.encode())  # read here once (~0.4 s), not in the engine's step
    return params_from_body(body, defaults, grammar.compile(grammar.Gbnf(text), model), trigger)
