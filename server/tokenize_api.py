"""vLLM's token endpoints: /tokenize, /detokenize, and the render endpoints that turn a request into
its token ids.

Routers that place requests by their token blocks ask the node for these:
vllm-router's kv_aware and cache_aware policies POST a chat request to
/v1/chat/completions/render to learn the exact token ids the node would run,
so that their block hashes line up with the node's KV-cache events. Each
answers exactly what the matching /v1/... request would run (the same chat
template call, the same checks and errors), in vLLM's shapes.
"""

from __future__ import annotations

import functools
import uuid
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from server.errors import UNION_TAGS
from server.protocol import (
    INT64_MAX,
    ChatCompletionRequest,
    ChatMessage,
    ChatTemplateInput,
    CompletionRequest,
    Tool,
    unsupported,
)
from server.request_path import RequestPath


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a prompt."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateInput, BaseModel):
    """POST /tokenize with messages: the ids the chat template makes of them."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[Tool] | None = None
    # As on /v1/chat/completions: a template other than the model's would tokenize what the node
    # never runs.
    chat_template: Annotated[Any, unsupported()] = None
    chat_template_kwargs: dict[str, Any] | None = None  # as on /v1/chat/completions

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChatRequest:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("set at most one of add_generation_prompt and continue_final_message")
        return self


def _tokenize_kind(body: Any) -> str:
    """Which request a /tokenize body is: a chat one when it has messages, else a prompt's (whose
    error then names the missing prompt, not both shapes' fields)."""
    return "tokenize-chat" if isinstance(body, dict) and "messages" in body else "tokenize-prompt"


TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("tokenize-chat")]
    | Annotated[TokenizeCompletionRequest, Tag("tokenize-prompt")],
    Discriminator(_tokenize_kind),
]
UNION_TAGS.update({"tokenize-chat", "tokenize-prompt"})  # no field is named with a dash


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT64_MAX)]]


def add_token_routes(app: FastAPI, path: RequestPath) -> None:
    """Add the routes; the render endpoints run path's chat_prompt and completion_prompt, what
    /v1/chat/completions and /v1/completions run."""
    model, off_loop = path.model, path.off_loop

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        model.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            model.need_chat_template()
            ids = await off_loop(
                model.chat_prompt_ids,
                body.template_messages(),
                body.template_tools(),
                body.add_generation_prompt,
                body.continue_final_message,
                body.add_special_tokens,
                model.chat_template_kwargs(body.chat_template_kwargs),
            )
        else:
            model.need_tokenizer("prompt")
            ids = await off_loop(
                functools.partial(model.encode, add_special_tokens=body.add_special_tokens),
                body.prompt,
                "prompt",
            )
        strs = (
            await off_loop(model.tokenizer.convert_ids_to_tokens, ids)
            if body.return_token_strs
            else None
        )
        return {
            "count": len(ids),
            "max_model_len": model.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        model.check_model(body.model)
        model.need_tokenizer("tokens")
        model.check_token_ids(body.tokens, "tokens")
        return {"prompt": await off_loop(model.tokenizer.decode, body.tokens)}

    @app.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest) -> dict:
        return render(body, await path.chat_prompt(body), "chatcmpl")

    @app.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest) -> list[dict]:
        return [
            render(body, await path.completion_prompt(body), "cmpl")
        ]  # vLLM's answers one per prompt

    def render(
        body: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int], kind: str
    ) -> dict:
        """vLLM's GenerateRequest for the prompt: its token ids and the sampling parameters it would
        run with."""
        max_tokens = max(1, model.resolve_max_tokens(body, len(prompt_ids)))
        sampling = body.sampling_params(max_tokens, model.eos_token_ids, model.vocab_size)
        return {
            "request_id": f"{kind}-{uuid.uuid4().hex}",
            "token_ids": prompt_ids,
            "model": body.model,
            "sampling_params": msgspec.to_builtins(sampling),
            "stream": body.stream,
            "return_token_ids": body.return_token_ids,
            "cache_salt": None,
        }
