"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, for agents written
against Claude.

A request runs as the chat completions request it amounts to (system, messages with text, tool_use
and tool_result blocks, tools, tool_choice, stop_sequences, sampling) through the shared request
path; the answer comes back as content blocks (text, tool_use), or streamed as Anthropic's events.
usage reports the prefix cache's hits as cache_read_input_tokens (input_tokens counts the rest, as
Anthropic counts it); errors have Anthropic's shape (server/errors.py), and x-api-key is taken where
--api-key is set (server/guard.py).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any, Literal

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from server.cache_hints import anthropic_hints
from server.errors import RequestError, anthropic_error_body
from server.output_blocks import Block, BlockEvent, OutputBlocks, blocks_of
from server.protocol import (
    INT64_MAX,
    ChatCompletionRequest,
    RequestBody,
    chat_request_as,
    unsupported,
)
from server.request_path import Generation, RequestPath
from server.request_types import Event, Prompt

_json = msgspec.json.Encoder()


class MessagesRequest(RequestBody):
    """Body of POST /v1/messages (and, without max_tokens, of /v1/messages/count_tokens)."""

    model: str | None = None  # the one served model when left out
    messages: list[dict[str, Any]]
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT64_MAX)
    stream: bool = False
    metadata: dict[str, Any] | None = None  # user_id: accepted and ignored
    # extended thinking: {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}, the
    # template's enable_thinking (the budget is not enforced: max_tokens bounds the whole answer)
    thinking: dict[str, Any] | None = None
    container: Annotated[Any, unsupported()] = None
    mcp_servers: Annotated[Any, unsupported([])] = None
    output_config: Annotated[Any, unsupported({})] = (
        None  # structured outputs: use a forced tool instead
    )

    def chat_messages(self) -> list[dict[str, Any]]:
        """system and messages as chat messages: a tool_use block becomes a tool call of its
        assistant message, a tool_result block a tool message; other block types are refused by
        name."""
        out: list[dict[str, Any]] = []
        if self.system is not None:
            out.append({"role": "system", "content": _text(self.system, "system")})
        if not self.messages:
            raise RequestError("messages: at least one message is required", param="messages")
        for i, message in enumerate(self.messages):
            where = f"messages[{i}]"
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ("user", "assistant"):
                raise RequestError(
                    f"{where}.role: {json.dumps(role)} is not user or assistant (the system prompt "
                    "goes "
                    "in system)",
                    param=f"{where}.role",
                )
            content = message.get("content")
            if isinstance(content, str):
                out.append({"role": role, "content": content})
                continue
            if not isinstance(content, list):
                raise RequestError(
                    f"{where}.content must be a string or a list of content blocks",
                    param=f"{where}.content",
                )
            texts, calls, thoughts = [], [], []
            for j, block in enumerate(content):
                at = f"{where}.content[{j}]"
                kind = block.get("type") if isinstance(block, dict) else None
                if kind == "text" and isinstance(block.get("text"), str):
                    texts.append(block["text"])
                elif kind == "thinking" and role == "assistant":  # an answer's thinking, sent back
                    thoughts.append(str(block.get("thinking", "")))
                elif kind == "redacted_thinking" and role == "assistant":
                    continue  # another server's encrypted thinking: nothing to show the template
                elif kind == "tool_use" and role == "assistant":
                    if not isinstance(block.get("id"), str) or not isinstance(
                        block.get("name"), str
                    ):
                        raise RequestError(
                            f"{at}: a tool_use block needs an id and a name", param=at
                        )
                    calls.append(
                        {
                            "id": block["id"],
                            "type": "function",
                            "function": {
                                "name": block["name"],
                                "arguments": json.dumps(block.get("input", {}), ensure_ascii=False),
                            },
                        }
                    )
                elif kind == "tool_result" and role == "user":
                    if not isinstance(block.get("tool_use_id"), str):
                        raise RequestError(
                            f"{at}: a tool_result block needs a tool_use_id",
                            param=f"{at}.tool_use_id",
                        )
                    result = block.get("content", "")
                    out.append(
                        {
                            "role": "tool",
                            "tool_call_id": block["tool_use_id"],
                            "content": _text(result, f"{at}.content") if result else "",
                        }
                    )
                else:
                    raise RequestError(
                        f"{at}: content blocks of type {json.dumps(kind)} are not supported in a "
                        f"{role} message; send text, thinking and tool_use (assistant) and "
                        "tool_result (user) blocks",
                        param=f"{at}.type",
                    )
            if texts or calls:
                joined = "\n".join(texts) if texts or not calls else None
                message_out: dict[str, Any] = {"role": role, "content": joined}
                if calls:
                    message_out["tool_calls"] = calls
                if thoughts:
                    message_out["reasoning_content"] = "\n".join(thoughts)
                out.append(message_out)
        return out

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if (
                not isinstance(tool, dict)
                or "input_schema" not in tool
                or tool.get("type", "custom") != "custom"
            ):
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise RequestError(
                    f"tools[{i}]: only custom tools (name, description, input_schema) are "
                    "supported, "
                    f"not {json.dumps(kind)}",
                    param=f"tools[{i}]",
                )
            out.append(
                {
                    "type": "function",
                    "function": {
                        k2: tool[k1]
                        for k1, k2 in (
                            ("name", "name"),
                            ("description", "description"),
                            ("input_schema", "parameters"),
                        )
                        if k1 in tool
                    },
                }
            )
        return out

    def template_kwargs(self) -> dict[str, Any] | None:
        """thinking as the chat template's enable_thinking (None: the server's default)."""
        if self.thinking is None:
            return None
        kind = self.thinking.get("type")
        if kind not in ("enabled", "disabled"):
            raise RequestError(
                f"thinking.type {json.dumps(kind)} is not enabled or disabled", param="thinking"
            )
        return {"enable_thinking": kind == "enabled"}

    def chat_tool_choice(self) -> tuple[Any, bool | None]:
        """tool_choice as chat's, and parallel_tool_calls (None: the default)."""
        choice = self.tool_choice
        if choice is None:
            return None, None
        kind = choice.get("type")
        parallel = False if choice.get("disable_parallel_tool_use") else None
        if kind == "tool" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}, parallel
        mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if mapped is None:
            raise RequestError(
                f"tool_choice type {json.dumps(kind)} is not one of auto, any, tool (with a name), "
                "none",
                param="tool_choice",
            )
        return mapped, parallel

    def chat_request(self) -> ChatCompletionRequest:
        choice, parallel = self.chat_tool_choice()
        fields = {
            "model": self.model,
            "messages": self.chat_messages(),
            "max_completion_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences or None,
            "tools": self.chat_tools(),
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
            "stream": self.stream,
            "chat_template_kwargs": self.template_kwargs(),
        }
        return chat_request_as(
            fields, {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}
        )


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 1  # count_tokens takes none


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" for b in content
    ):
        return "\n".join(b.get("text", "") for b in content)
    raise RequestError(f"{where} must be a string or a list of text blocks", param=where)


def add_messages_routes(app: FastAPI, path: RequestPath) -> None:
    model = path.model

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict:
        return {"input_tokens": len(await path.chat_prompt(body.chat_request()))}

    @app.post("/v1/messages")
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        chat = body.chat_request()
        hints = anthropic_hints(body.system, body.tools, body.messages)
        try:
            gen = await path.start(chat, Prompt(await path.chat_prompt(chat)), request, hints)
        except RequestError as exc:
            raise in_anthropic_terms(exc) from None
        return await path.respond(
            gen,
            request,
            MessageRun(new_message_id(), model.name, gen, path.client.router.block_size),
        )


# The request path names tool choices as chat completions does; Anthropic's clients know them by
# these.
ANTHROPIC_TOOL_CHOICES = (
    ('tool_choice "auto"', 'tool_choice {"type": "auto"}'),
    ('tool_choice "required"', 'tool_choice {"type": "any"}'),
    ("a named function", '{"type": "tool", "name": ...}'),
)


def in_anthropic_terms(exc: RequestError) -> RequestError:
    """A request path error about the tool choice, in the Messages API's terms."""
    if exc.param != "tool_choice":
        return exc
    message = exc.message
    for openai_words, anthropic_words in ANTHROPIC_TOOL_CHOICES:
        message = message.replace(openai_words, anthropic_words)
    return RequestError(message, status=exc.status, param=exc.param)


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def tool_use_id(call_id: str | None) -> str:
    """A call id in Anthropic's shape (toolu_...)."""
    return "toolu_" + (call_id or uuid.uuid4().hex).removeprefix("call_")


class MessageRun:
    """One message as it is generated (server/answer.py's Answer): its blocks, its body, its stream
    of events (message_start, each content block's events, message_delta, message_stop)."""

    def __init__(
        self, message_id: str, model_name: str, gen: Generation, block_size: int = 16
    ) -> None:
        self.id, self.model_name, self.gen = message_id, model_name, gen
        self.block_size = block_size  # the prefix cache's: only whole blocks are cached
        self.choice = gen.choices[0]
        self.streamed = OutputBlocks(self.choice)  # a stream's blocks as they come

    async def whole(self) -> dict[str, Any]:
        return self.message(blocks_of(self.choice))

    def block(self, b: Block, done: bool = True) -> dict[str, Any]:
        if b.kind == "reasoning":  # ppd signs no thinking: the signature is empty
            return {"type": "thinking", "thinking": b.text if done else "", "signature": ""}
        if b.kind == "text":
            return {"type": "text", "text": b.text if done else ""}
        return {
            "type": "tool_use",
            "id": tool_use_id(b.call_id),
            "name": b.name,
            "input": b.arguments() if done else {},
        }

    def stop(self, blocks: list[Block]) -> tuple[str, str | None]:
        """stop_reason and stop_sequence."""
        c = self.choice
        if c.finish_reason == "length":
            return "max_tokens", None
        if getattr(c.detok, "stop_string", None):
            return "stop_sequence", c.detok.stop_string
        if any(b.kind == "tool_call" for b in blocks):
            return "tool_use", None
        return "end_turn", None

    def usage(self, output_tokens: int) -> dict[str, Any]:
        """Anthropic's usage: cache_read the prompt's tokens served from the prefix cache (or
        loaded from the second tier); with a cache_control, cache_creation the tokens this request
        computed and left cached (its whole blocks past the cached prefix), input the rest.
        Without one, nothing is reported created (the server caches every prompt anyway)."""
        num_prompt, cached = len(self.gen.prompt.token_ids), self.choice.num_cached
        ttl = self.gen.hints.retention
        created = max(0, num_prompt // self.block_size * self.block_size - cached) if ttl else 0
        out: dict[str, Any] = {
            "input_tokens": num_prompt - cached - created,
            "output_tokens": output_tokens,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": created,
        }
        if ttl is not None:
            out["cache_creation"] = {
                "ephemeral_5m_input_tokens": created if ttl == "5m" else 0,
                "ephemeral_1h_input_tokens": created if ttl == "1h" else 0,
            }
            out["ppd_cache_retention"] = self.gen.retention
        return out

    def message(self, blocks: list[Block], final: bool = True) -> dict[str, Any]:
        reason, sequence = self.stop(blocks) if final else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model_name,
            "content": [self.block(b) for b in blocks] if final else [],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self.usage(len(self.choice.token_ids) if final else 0),
        }

    def block_event(self, e: BlockEvent) -> bytes:
        b = e.block
        if e.what == "start":
            return sse(
                "content_block_start", index=b.index, content_block=self.block(b, done=False)
            )
        if e.what == "stop":
            return sse("content_block_stop", index=b.index)
        delta = {
            "text": {"type": "text_delta", "text": e.delta},
            "reasoning": {"type": "thinking_delta", "thinking": e.delta},
            "tool_call": {"type": "input_json_delta", "partial_json": e.delta},
        }[b.kind]
        return sse("content_block_delta", index=b.index, delta=delta)

    def opening(self) -> list[bytes]:
        return [sse("message_start", message=self.message([], final=False))]

    def chunks(self, event: Event) -> Iterator[bytes]:
        for e in self.streamed.feed(event.text, final=event.finish_reason is not None):
            yield self.block_event(e)

    async def closing(self) -> AsyncIterator[bytes]:
        reason, sequence = self.stop(self.streamed.blocks)
        yield sse(
            "message_delta",
            delta={"stop_reason": reason, "stop_sequence": sequence},
            usage={"output_tokens": len(self.choice.token_ids)},
        )
        yield sse("message_stop")

    def error(self, status: int, message: str) -> list[bytes]:
        return [sse("error", error=anthropic_error_body(message, status)["error"])]


def sse(
    kind: Literal[
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
        "error",
    ],
    **fields: Any,
) -> bytes:
    return (
        b"event: " + kind.encode() + b"\ndata: " + _json.encode({"type": kind, **fields}) + b"\n\n"
    )
