"""OpenAI's chat and text completions: POST /v1/chat/completions and /v1/completions.

The body's messages go through the model's chat template (completions: the prompt, as text or token ids), then
through the shared request path; the choices come back as OpenAI's chat.completion or text_completion, or streamed
as their chunks.
"""

from __future__ import annotations

import time
import uuid

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from server.request_path import RequestPath
from server.responses import Prompt, choice_body, prompt_logprobs_body, stream_events, usage

_json = msgspec.json.Encoder()


def add_chat_routes(app: FastAPI, path: RequestPath) -> None:
    model = path.model

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await respond(body, Prompt(await path.chat_prompt(body)), request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        echo = None
        prompt_ids = await path.completion_prompt(body)
        if body.echo:
            model.need_tokenizer("echo")
            echo = body.prompt if isinstance(body.prompt, str) else await path.off_loop(model.tokenizer.decode,
                                                                                         prompt_ids)
        return await respond(body, Prompt(prompt_ids, echo), request, chat=False)

    async def respond(body: SamplingRequest, prompt: Prompt, request: Request, chat: bool) -> Response:
        gen = await path.start(body, prompt, request)
        body = gen.body  # without a tokenizer: return_token_ids set
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.stream:
            here, first = await path.first_event(gen, request)
            if not here:
                return Response(status_code=499)
            sse = stream_events(response_id, body, chat, gen.choices, prompt, gen.events, first, model.token_text)
            return StreamingResponse(sse, media_type="text/event-stream", headers=gen.headers)
        if not await path.finish(gen, request):
            return Response(status_code=499)
        choices = gen.choices
        result = {"id": response_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                  "model": model.name, "choices": [choice_body(c, chat, body, model.token_text, prompt) for c in choices],
                  "usage": usage(prompt.token_ids, choices)}
        if chat and body.prompt_logprobs is not None:
            result["prompt_logprobs"] = prompt_logprobs_body(body, prompt, choices[0], model.token_text)
        if body.return_token_ids:
            result["prompt_token_ids"] = prompt.token_ids
        return Response(_json.encode(result), media_type="application/json", headers=gen.headers)
