"""The body of OpenAI's POST /v1/responses, validated, and its input items turned into chat
messages.

Function tools, text and JSON-schema output, stored conversations (previous_response_id) and
streaming are served, and reasoning items sent back (a reasoning model's thinking, given to the
template with the answer after it); what is not (built-in tools such as web search, the reasoning
field, background runs, images and files in the input) is refused with a 400 naming the field,
never ignored. vLLM's
sampling extensions (top_k, min_p, seed, repetition_penalty, ignore_eos) are taken as on chat
completions.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from server.errors import RequestError
from server.protocol import INT64_MAX, INT64_MIN, MAX_CACHE_KEY_CHARS, RequestBody, unsupported
from server.tools import FunctionDefinition

MAX_METADATA_KEYS = 16


class TextFormat(BaseModel):
    """text.format: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None
    verbosity: Any = None  # a hint for reasoning models; accepted and ignored


class ResponsesRequest(RequestBody):
    """Body of POST /v1/responses."""

    model: str | None = None  # the one served model when left out
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: TextConfig | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # accepted and ignored, as are service_tier and safety_identifier
    # OpenAI's cache hints, as on chat completions (server/cache_hints.py).
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=MAX_CACHE_KEY_CHARS)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # vLLM's sampling extensions
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None

    # Not served: accepted only when absent, null or asking for nothing.
    background: Annotated[Any, unsupported(False)] = None
    reasoning: Annotated[Any, unsupported({})] = None
    include: Annotated[Any, unsupported([])] = None
    top_logprobs: Annotated[Any, unsupported(0)] = None
    truncation: Annotated[Any, unsupported("disabled")] = None
    conversation: Annotated[Any, unsupported()] = None
    prompt: Annotated[Any, unsupported()] = None
    max_tool_calls: Annotated[Any, unsupported()] = None
    context_management: Annotated[Any, unsupported()] = None

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: str | list) -> str | list:
        if isinstance(value, list) and not value:
            raise ValueError("must hold at least one item")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys are allowed, got {len(value)}")
        return value

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools in chat completions' shape; anything but a function tool is refused by name."""
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise RequestError(
                    f"tools[{i}]: tools of type {json.dumps(kind)} (built-in tools) are not "
                    "supported "
                    "by this server; send function tools "
                    '({"type": "function", "name", "parameters"})',
                    param=f"tools[{i}].type",
                )
            function = {
                k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
            }
            try:
                FunctionDefinition.model_validate(function)
            except ValueError as exc:
                raise RequestError(
                    f"tools[{i}]: {_first_error(exc)}", param=f"tools[{i}]"
                ) from None
            out.append({"type": "function", "function": function})
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        if (
            isinstance(choice, dict)
            and choice.get("type") == "function"
            and isinstance(choice.get("name"), str)
        ):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise RequestError(
            f'tool_choice {json.dumps(choice)} is not supported: use "none", "auto", "required" '
            'or {"type": "function", "name": ...}',
            param="tool_choice",
        )

    def response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.schema_ is None:
            raise RequestError(
                'text.format of type "json_schema" needs a "schema"', param="text.format.schema"
            )
        return {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.name or "response",
                "schema": fmt.schema_,
                "strict": fmt.strict,
            },
        }

    def chat_fields(self) -> dict[str, Any]:
        """The sampling and output fields of the chat completions request this runs as (messages
        apart)."""
        fields = {
            "model": self.model,
            "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "repetition_penalty": self.repetition_penalty,
            "ignore_eos": self.ignore_eos,
            "tools": self.chat_tools(),
            "tool_choice": self.chat_tool_choice(),
            "response_format": self.response_format(),
            "prompt_cache_key": self.prompt_cache_key,
            "prompt_cache_retention": self.prompt_cache_retention,
        }
        if self.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        return {k: v for k, v in fields.items() if v is not None}


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    first = errors()[0]
    return str(first.get("ctx", {}).get("error", first.get("msg")))


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as chat messages (OpenAI's shape): messages, function calls (joined into one
    assistant message when consecutive) and their outputs. An item type this server cannot take
    is refused by name."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call_id -> function name, for the tool messages that answer them
    thought: str | None = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where}: an input item must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(
                    f"{where}: role {json.dumps(role)} is not one of user, assistant, system, "
                    "developer",
                    param=f"{where}.role",
                )
            messages.append(
                {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            )
            if role == "assistant" and thought is not None:
                messages[-1]["reasoning_content"], thought = thought, None
        elif kind == "function_call":
            call_id, name, arguments = (item.get(k) for k in ("call_id", "name", "arguments"))
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise RequestError(
                    f"{where}: a function_call item needs call_id, name and arguments (strings)",
                    param=where,
                )
            try:
                json.loads(arguments)
            except ValueError:
                raise RequestError(
                    f"{where}.arguments is not JSON text; send the arguments the model returned",
                    param=f"{where}.arguments",
                ) from None
            names[call_id] = name
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            last = messages[-1] if messages else None
            if (
                last is not None
                and last["role"] == "assistant"
                and (last.get("tool_calls") or not last["content"])
            ):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if thought is not None:
                messages[-1]["reasoning_content"], thought = thought, None
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise RequestError(
                    f"{where}: a function_call_output item needs a call_id",
                    param=f"{where}.call_id",
                )
            message = {
                "role": "tool",
                "tool_call_id": call_id,
                "content": _text(output, f"{where}.output"),
            }
            if call_id in names:
                message["name"] = names[call_id]
            messages.append(message)
        elif kind == "reasoning":  # an earlier answer's thinking (--reasoning-parser), sent back
            parts = [*(item.get("content") or []), *(item.get("summary") or [])]
            texts = [p.get("text") for p in parts if isinstance(p, dict)]
            thought = "".join(t for t in texts if isinstance(t, str))
        else:
            raise RequestError(
                f"{where}: input items of type {json.dumps(kind)} are not supported; send message, "
                "function_call and function_call_output items",
                param=f"{where}.type",
            )
    return messages


def _text(content: Any, where: str) -> str:
    """A content field (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of input_text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise RequestError(
                f"{where}[{j}]: content of type {json.dumps(kind)} is not supported; only text "
                "(input_text, output_text) is",
                param=f"{where}[{j}].type",
            )
        texts.append(part["text"])
    return "\n".join(texts)
