"""OpenAI's chat and text completions: POST /v1/chat/completions and /v1/completions.

The body's messages go through the model's chat template (completions: the prompt, as text or token
ids), then through the shared request path; the choices come back as OpenAI's chat.completion or
text_completion, or streamed as their chunks (server/chat_bodies.py).
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response

from server.chat_bodies import ChatAnswer, TokenText
from server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from server.request_path import RequestPath
from server.request_types import Prompt


def add_chat_routes(app: FastAPI, path: RequestPath) -> None:
    model = path.model
    token_text = TokenText(model.tokenizer)  # logprobs' token texts, cached across requests

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await respond(body, Prompt(await path.chat_prompt(body)), request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        echo = None
        prompt_ids = await path.completion_prompt(body)
        if body.echo:
            model.need_tokenizer("echo")
            echo = (
                body.prompt
                if isinstance(body.prompt, str)
                else await path.off_loop(model.tokenizer.decode, prompt_ids)
            )
        return await respond(body, Prompt(prompt_ids, echo), request, chat=False)

    async def respond(
        body: SamplingRequest, prompt: Prompt, request: Request, chat: bool
    ) -> Response:
        gen = await path.start(
            body, prompt, request
        )  # without a tokenizer, gen.body has return_token_ids set
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        return await path.respond(
            gen,
            request,
            ChatAnswer(
                response_id,
                gen,
                chat,
                model.name,
                token_text,
                model.response_role,
                model.force_usage,
            ),
        )
