"""The API dialects the slot server speaks, one module each: its body, its conversion to the chat request (the chat
APIs), its wire format (``sse.WireFormat``), its router, and the error shape its router declares (``errors.Dialect``).

    openai_chat   OpenAI Chat Completions: /v1/chat/completions                 [post_chat_completions, to_json_oaicompat_chat]
    openai_text   OpenAI Completions: /v1/completions                            [post_completions_oai, to_json_oaicompat]
    native        llama-server's own: /completion, /completions                  [post_completions, to_json_non_oaicompat]
    responses     OpenAI Responses: /v1/responses, its input_tokens              [post_responses_oai, to_json_oaicompat_resp]
    messages      Anthropic Messages: /v1/messages, its count_tokens             [post_anthropic_messages, to_json_anthropic]
    openai        what the two OpenAI dialects share: the envelope, usage, finish_reason, logprobs
    blocks        Blocks: a stream's typed blocks, which Responses and Messages both write

Every one takes the one request path, ``generation`` (chat, Responses and Messages through ``generation.chat``).
A new dialect is a module here with those parts and its router in ``ROUTERS``.
"""

from llmkit.server.dialects import messages, native, openai_chat, openai_text, responses

ROUTERS = (openai_chat.router, openai_text.router, native.router, responses.router, messages.router)
