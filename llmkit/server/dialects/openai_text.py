"""OpenAI's (legacy) Completions (~ llama-server's post_completions_oai, server-task.cpp ``to_json_oaicompat``).

    POST /v1/completions    a text completion of a prompt (text or token ids), whole or streamed (SSE)

``TextFormatter`` writes the answer in ``openai.OpenAIFormatter``'s envelope: ``text`` in each choice, and
logprobs in both shapes, llama-server's ``content`` and OpenAI's legacy lists. (Without ``/v1``,
``/completions`` is llama-server's own dialect: ``native``.)
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import Field

from llmkit.engine.request import TokenLogprob
from llmkit.server.dialects.openai import OpenAIFormatter, openai_formatter
from llmkit.server.errors import LLAMA_SERVER, off_loop
from llmkit.server.generation import generate
from llmkit.server.protocol import GenerationRequest, check_tokens
from llmkit.server.sse import Answer
from llmkit.server.state import State
from llmkit.server.tools import Delta

router = APIRouter(dependencies=[Depends(LLAMA_SERVER)])


class CompletionRequest(GenerationRequest):
    # a string, or (OpenAI) a token list, or a list holding one of those: n = 1 prompt only
    prompt: (
        str
        | list[int]
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[list[int]], Field(min_length=1, max_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    def n_top_logprobs(self) -> int | None:
        return self.logprobs if self.logprobs is not None else super().n_top_logprobs()

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        return p[0] if isinstance(p, list) and p and isinstance(p[0], (str, list)) else p  # type: ignore[return-value]  # mypy cannot narrow p[0]


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http_request: Request, state: State) -> Any:
    model = state.engine.model
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        tokens = await off_loop(model.tokenize, prompt)
    else:
        tokens = check_tokens(prompt, model.n_vocab, "prompt")
    return await generate(http_request, state, body, tokens, openai_formatter(TextFormatter, state, body))


class TextFormatter(OpenAIFormatter):
    """The JSON objects of one text completion (llama-server: ``to_json_oaicompat``)."""

    ID_PREFIX, OBJECT, CHUNK_OBJECT, END = "cmpl-", "text_completion", "text_completion", {"text": ""}

    def body(self, answer: Answer) -> dict:
        return {"text": answer.content}

    def delta(self, d: Delta) -> dict:
        return {"text": d.content}

    def logprobs(self, items: list[TokenLogprob]) -> dict | None:
        """llama-server's ``content``, and OpenAI's legacy lists beside it."""
        shown = super().logprobs(items)
        if shown is None:
            return None
        content = shown["content"]
        return {
            "tokens": [c["token"] for c in content],
            "token_logprobs": [c["logprob"] for c in content],
            "top_logprobs": [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content],
            "content": content,
        }
