"""Request bodies of the OpenAI-compatible API, validated with pydantic.

Follows the OpenAI API plus vLLM's sampling extensions (top_k, min_tokens,
ignore_eos, stop_token_ids, return_token_ids). A field that would change the
output in a way we do not implement (logprobs, penalties, tools, ...) is
rejected by name with a 400, never silently ignored; unknown fields are
ignored, as vLLM does. Checks that need the model (token ids against the
vocabulary, prompt + max_tokens against the context length) belong to the API
server.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from http import HTTPStatus
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from engine.sampling_params import SamplingParams

MAX_N = 16
MAX_STOP_STRINGS = 16  # OpenAI takes 4; every one is matched against every new piece of text
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
# OpenAI's /v1/completions default; chat has none (the server fills the context).
DEFAULT_COMPLETION_MAX_TOKENS = 16
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_ERROR_TYPES = {  # the names of the openai client's exception classes where it has one
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_type(status: int) -> str:
    """The OpenAI/vLLM error type for an HTTP status, e.g. 400 -> "BadRequestError"."""
    return _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"


def error_body(message: str, type: str, param: str | None = None, code: int | None = None) -> dict[str, Any]:
    """The JSON body of an error response, shaped as OpenAI and vLLM shape it. A message may quote the client's
    input, which may hold lone surrogates (valid JSON, not valid UTF-8): they are escaped, not sent."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if param is not None:
        param = param.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class RequestError(Exception):
    """An error the client caused (or must wait out); the API answers it with `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = error_type(status)
        self.code = status

    def body(self) -> dict[str, Any]:
        """This error as a response body."""
        return error_body(self.message, self.type, self.param, self.code)


def validation_error_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """Turn pydantic's (or FastAPI's) errors into one readable message and the first bad field.

    The field is a dotted path into the body, e.g. "messages.0.content".
    """
    messages: list[str] = []
    params: list[str] = []
    for error in exc.errors():
        loc = [str(part) for part in error.get("loc", ())]
        if loc[:1] == ["body"]:  # FastAPI prefixes where the value came from
            loc = loc[1:]
        if error.get("type") == "json_invalid":
            detail = error.get("ctx", {}).get("error", error.get("msg", ""))
            return f"The request body is not valid JSON: {detail}", None
        if error.get("type") == "missing" and not loc:
            return "The request needs a JSON body", None
        if error.get("type") == "value_error" and "error" in error.get("ctx", {}):
            msg = str(error["ctx"]["error"])  # our own message, without pydantic's "Value error, " prefix
        else:
            msg = error.get("msg", "invalid value")
        param = ".".join(loc)
        params.append(param)
        messages.append(f"{param or 'request body'}: {msg}")
    return "; ".join(messages) or "invalid request", next((p for p in params if p), None)


def _unsupported(*no_op_values: Any) -> AfterValidator:
    """Reject a field unless it is null or one of `no_op_values` (values that ask for nothing)."""
    allowed = (None, *no_op_values)
    settings = " or ".join(json.dumps(v) for v in no_op_values)
    fix = f"remove it or set it to {settings}" if settings else "remove it"

    def check(value: Any) -> Any:
        # Compare types too: 0 == False, but {"logprobs": 0} is a request for logprobs.
        if not any(value == ok and type(value) is type(ok) for ok in allowed):
            raise ValueError(f"not supported by this server; {fix}")
        return value

    return AfterValidator(check)


def _float_no_op(value: float) -> AfterValidator:
    """Like _unsupported for a number: any value equal to `value` (1 or 1.0) is accepted."""

    def check(given: Any) -> Any:
        if given is not None and given != value:
            raise ValueError(f"not supported by this server; remove it or set it to {value:g}")
        return given

    return AfterValidator(check)


class StreamOptions(BaseModel):
    """OpenAI's stream_options: include_usage adds a final chunk with token counts."""

    include_usage: bool = False


class TextPart(BaseModel):
    """One {"type": "text", "text": ...} part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message. "developer" is OpenAI's newer name for "system" and is treated as it.

    Tool messages and tool calls are rejected: tool calling is not implemented.
    """

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # accepted and ignored, as by most chat templates
    tool_calls: Annotated[Any, _unsupported([])] = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        # Checked here in full so that the client gets one clear message instead
        # of pydantic's report on each member of the union.
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts')
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"only text content is supported; part {i} has type {json.dumps(kind)}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f'part {i} of type "text" needs a string "text" field')
        return content

    @property
    def text(self) -> str:
        """The content as one string; text parts are joined with newlines, as vLLM joins them."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class SamplingRequest(BaseModel):
    """The fields /v1/chat/completions and /v1/completions share, and their mapping to SamplingParams."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)  # vLLM: -1 or 0 turn it off
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    return_token_ids: bool = False
    user: str | None = None  # accepted and ignored

    # Not implemented: accepted only when absent, null or set to a value that asks for nothing.
    presence_penalty: Annotated[Any, _float_no_op(0.0)] = None
    frequency_penalty: Annotated[Any, _float_no_op(0.0)] = None
    repetition_penalty: Annotated[Any, _float_no_op(1.0)] = None
    min_p: Annotated[Any, _float_no_op(0.0)] = None
    logit_bias: Annotated[Any, _unsupported({})] = None
    response_format: Annotated[Any, _unsupported({"type": "text"})] = None
    use_beam_search: Annotated[Any, _unsupported(False)] = None
    prompt_logprobs: Annotated[Any, _unsupported()] = None
    structured_outputs: Annotated[Any, _unsupported()] = None
    include_stop_str_in_output: Annotated[Any, _unsupported(False)] = None
    skip_special_tokens: Annotated[Any, _unsupported(True)] = None
    truncate_prompt_tokens: Annotated[Any, _unsupported()] = None

    @field_validator("n")
    @classmethod
    def _cap_n(cls, n: int) -> int:
        if n > MAX_N:
            raise ValueError(f"at most {MAX_N} choices per request are supported; send several requests for more")
        return n

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream=true; remove it or set stream to true")
        return options

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, stop: Any) -> Any:
        if stop is None:
            return None
        strings = [stop] if isinstance(stop, str) else stop
        if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
            raise ValueError("must be a string or a list of strings")
        if any(s == "" for s in strings):
            raise ValueError("must not contain empty strings")
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(strings)}")
        if (longest := max(map(len, strings))) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got {longest}")
        return stop

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _check_stop_ids(cls, ids: Any) -> Any:
        if isinstance(ids, list) and len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed, got {len(ids)}")
        return ids

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings, as a tuple (empty when none)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def requested_max_tokens(self) -> int | None:
        """The client's output budget; None means "up to the end of the context"."""
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, eos_token_ids: Sequence[int]) -> SamplingParams:
        """The engine's parameters for one choice; `max_tokens` is the budget the server resolved.

        The model's EOS ids join stop_token_ids unless ignore_eos, so the engine
        stops on (and, before min_tokens, suppresses) a single set of ids.
        Greedy (temperature 0) drops top_p and top_k, which cannot change it.
        """
        if self.min_tokens > max_tokens:
            raise RequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens}); lower min_tokens",
                param="min_tokens",
            )
        stop_ids = list(self.stop_token_ids or ())
        if not self.ignore_eos:
            stop_ids += eos_token_ids
        temperature = 1.0 if self.temperature is None else self.temperature
        greedy = temperature == 0.0
        return SamplingParams(
            temperature=temperature,
            top_p=1.0 if greedy or self.top_p is None else self.top_p,
            top_k=0 if greedy or self.top_k is None or self.top_k < 0 else self.top_k,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(dict.fromkeys(stop_ids)),
            ignore_eos=self.ignore_eos,
        )


class ChatCompletionRequest(SamplingRequest):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)

    # Not implemented, as in SamplingRequest.
    logprobs: Annotated[Any, _unsupported(False)] = None
    top_logprobs: Annotated[Any, _unsupported(0)] = None
    tools: Annotated[Any, _unsupported([])] = None
    tool_choice: Annotated[Any, _unsupported("none", "auto")] = None
    functions: Annotated[Any, _unsupported([])] = None
    function_call: Annotated[Any, _unsupported("none", "auto")] = None
    echo: Annotated[Any, _unsupported(False)] = None
    add_generation_prompt: Annotated[Any, _unsupported(True)] = None
    continue_final_message: Annotated[Any, _unsupported(False)] = None
    chat_template: Annotated[Any, _unsupported()] = None
    chat_template_kwargs: Annotated[Any, _unsupported({})] = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("at least one message is required")
        return messages

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens (OpenAI's older name); None if neither."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as {"role", "content": str} dicts for tokenizer.apply_chat_template."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in self.messages]


class CompletionRequest(SamplingRequest):
    """Body of POST /v1/completions: one prompt, as text or as token ids."""

    prompt: str | list[int]
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1)

    # Not implemented, as in SamplingRequest.
    logprobs: Annotated[Any, _unsupported()] = None
    echo: Annotated[Any, _unsupported(False)] = None
    suffix: Annotated[Any, _unsupported("")] = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        # A one-element batch is one prompt; real batches are refused rather
        # than answered with several choices the client may not expect.
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("must not be empty")
            return prompt
        if not isinstance(prompt, list):
            raise ValueError("must be a string or a list of token ids")
        if not prompt:
            raise ValueError("must not be empty")
        if all(isinstance(p, (str, list)) for p in prompt):
            raise ValueError("batched prompts are not supported; send one prompt per request")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise ValueError("token ids must be integers >= 0")
        return prompt

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and best_of != info.data.get("n", 1):
            raise ValueError("not supported by this server unless equal to n; remove it")
        return best_of
