"""Request bodies of the OpenAI-compatible API, validated with pydantic.

Follows the OpenAI API plus vLLM's sampling extensions (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, return_token_ids, guided_json/regex/choice/grammar and
structured_outputs). A field that would change the output in a way we do not implement (beam search,
suffix, ...) is rejected by name with a 400, never silently ignored; unknown fields are ignored, as
vLLM does, and named in the log once per field name. Checks that need the model (token ids against
the vocabulary, prompt + max_tokens against the context length) belong to the API server.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SAMPLING_EPS,
    GuidedSpec,
    SamplingParams,
)
from server.errors import RequestError, validation_error_message
from server.tools import NamedToolChoice, Tool, ToolCall, template_messages

log = logging.getLogger("ppd.api")

MAX_N = 16
MAX_STOP_STRINGS = 16  # OpenAI takes 4; every one is matched against every new piece of text
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
# OpenAI's /v1/completions default; chat has none (the server fills the context).
DEFAULT_COMPLETION_MAX_TOKENS = 16
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def unsupported(*no_op_values: Any) -> AfterValidator:
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
    """Like unsupported for a number: any value equal to `value` (1 or 1.0) is accepted."""

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
    """One chat message. "developer" is OpenAI's newer name for "system" and is treated as it. An
    assistant message may carry tool_calls (its content then may be null); a "tool" message answers
    one of them by tool_call_id."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None  # accepted and ignored, as by most chat templates
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # an earlier answer's thinking, as it came back (vLLM's name, and DeepSeek's older one): the
    # template sees it as reasoning_content
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _assistant_only(
        cls, calls: list[ToolCall] | None, info: ValidationInfo
    ) -> list[ToolCall] | None:
        if calls and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return calls

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any, info: ValidationInfo) -> Any:
        # Checked here in full so that the client gets one clear message instead
        # of pydantic's report on each member of the union.
        if content is None:
            if info.data.get("role") != "assistant":
                raise ValueError(
                    "is required (only an assistant message with tool_calls may leave it out)"
                )
            return content
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts')
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(
                    f"only text content is supported; part {i} has type {json.dumps(kind)}"
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(f'part {i} of type "text" needs a string "text" field')
        return content

    @property
    def text(self) -> str:
        """The content as one string; text parts are joined with newlines, as vLLM joins them (""
        for none)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part.text for part in self.content)

    def openai_dict(self) -> dict[str, Any]:
        """The message as OpenAI's JSON has it (tools.template_messages readies it for a chat
        template); a name is kept on a tool message only, the one role templates read it for."""
        out = self.model_dump(
            include={"role", "content", "tool_calls", "tool_call_id"}, exclude_none=True
        )
        if (thinking := self.reasoning_content or self.reasoning) and self.role == "assistant":
            out["reasoning_content"] = thinking
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


class JsonSchemaFormat(BaseModel):
    """response_format's json_schema: the schema the output must match (OpenAI's shape)."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object) or
    json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _with_type(
        cls, value: JsonSchemaFormat | None, info: ValidationInfo
    ) -> JsonSchemaFormat | None:
        if value is not None and info.data.get("type") != "json_schema":
            raise ValueError('only allowed with "type": "json_schema"')
        return value


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one constraint on the output."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class RequestBody(BaseModel):
    """A request's body. A top-level field the server does not know is ignored, as vLLM ignores it,
    and named in the log once per field name (vLLM names them on every request): a typo
    (`max_token`) shows there, and a client's newer fields do not fail its requests."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _name_ignored_fields(self) -> RequestBody:
        for name in self.model_extra or ():
            if name not in IGNORED_FIELDS and len(IGNORED_FIELDS) < MAX_IGNORED_NAMED:
                IGNORED_FIELDS.add(name)
                log.warning(
                    "a request's field %r is not one this server knows: ignored (said once per "
                    "field name%s)",
                    name[:80],
                    "; no more are named" if len(IGNORED_FIELDS) == MAX_IGNORED_NAMED else "",
                )
        return self


IGNORED_FIELDS: set[str] = set()  # unknown field names already logged
MAX_IGNORED_NAMED = 100  # a client inventing names cannot grow the set, or the log, without bound


MAX_CACHE_KEY_CHARS = 1024


class SamplingRequest(RequestBody):
    """The fields /v1/chat/completions and /v1/completions share, and their mapping to
    SamplingParams."""

    model: str | None = None  # the one served model when left out, as vLLM takes it
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
    # OpenAI's cache hints (server/cache_hints.py): the conversation's key, as x-session-id, and
    # how long its KV should outrank others'.
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=MAX_CACHE_KEY_CHARS)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None

    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # Bounded so that dividing a logit by it stays finite in float32 (a tiny penalty made logits
    # infinite).
    repetition_penalty: float | None = Field(
        None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS
    )  # vLLM's; its -1 (the whole vocabulary) is not

    # Not implemented: accepted only when absent, null or set to a value that asks for nothing.
    use_beam_search: Annotated[Any, unsupported(False)] = None
    include_stop_str_in_output: Annotated[Any, unsupported(False)] = None
    skip_special_tokens: Annotated[Any, unsupported(True)] = None
    truncate_prompt_tokens: Annotated[Any, unsupported()] = None

    @field_validator("n")
    @classmethod
    def _cap_n(cls, n: int) -> int:
        if n > MAX_N:
            raise ValueError(
                f"at most {MAX_N} choices per request are supported; send several requests for more"
            )
        return n

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream=true; remove it or set stream to true")
        return options

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isdigit() or int(key) > INT64_MAX:
                raise ValueError(f"keys must be token ids (integers >= 0, as strings), got {key!r}")
        return bias

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
            raise ValueError(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(strings)}"
            )
        if (longest := max(map(len, strings))) > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got {longest}"
            )
        return stop

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _check_stop_ids(cls, ids: Any) -> Any:
        if isinstance(ids, list) and len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed, got {len(ids)}"
            )
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

    @property
    def logprobs_asked(self) -> int | None:
        """Top alternatives per output token, or None when no logprobs are asked for."""
        return None

    @property
    def prompt_logprobs_asked(self) -> int | None:
        """Top alternatives per prompt token the engine computes (None: none); prompt_logprobs, or
        what echo shows."""
        return self.prompt_logprobs

    def guided_spec(self) -> tuple[GuidedSpec, str] | None:
        """The structured-output constraint the request asks for, and the field that asked (None:
        none)."""
        found: list[tuple[GuidedSpec, str]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append((GuidedSpec("json_object"), "response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise RequestError(
                    'response_format of type "json_schema" needs a "json_schema" object with a '
                    '"schema"',
                    param="response_format",
                )
            found.append(
                (GuidedSpec("json_schema", json.dumps(fmt.json_schema.schema_)), "response_format")
            )
        so = self.structured_outputs
        given = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
            "structured_outputs.json": so and so.json_,
            "structured_outputs.regex": so and so.regex,
            "structured_outputs.choice": so and so.choice,
            "structured_outputs.grammar": so and so.grammar,
            "structured_outputs.json_object": so and so.json_object or None,
        }
        for field, value in given.items():
            if value is None:
                continue
            kind = field.rsplit(".", 1)[-1].removeprefix("guided_")
            if kind == "json":
                text = value if isinstance(value, str) else json.dumps(value)
                found.append((GuidedSpec("json_schema", text), field))
            elif kind == "json_object":
                found.append((GuidedSpec("json_object"), field))
            elif kind == "choice":
                found.append((GuidedSpec("choice", json.dumps(value)), field))
            else:
                found.append((GuidedSpec(kind, value), field))  # type: ignore[arg-type]
        if len(found) > 1:
            raise RequestError(
                f"{found[0][1]} and {found[1][1]} both constrain the output; send one of them",
                param=found[1][1],
            )
        return found[0] if found else None

    def sampling_params(
        self,
        max_tokens: int,
        eos_token_ids: Sequence[int],
        vocab_size: int,
        guided: GuidedSpec | None = None,
    ) -> SamplingParams:
        """The engine's parameters for one choice; `max_tokens` is the budget the server resolved,
        `guided` the constraint on the output (from guided_spec, or a tool choice).

        The model's EOS ids join stop_token_ids unless ignore_eos, so the engine
        stops on (and, before min_tokens, suppresses) a single set of ids.
        Greedy (temperature 0) drops top_p, top_k and min_p, which cannot change it.
        """
        if guided is not None and (self.ignore_eos or self.min_tokens):
            field = "ignore_eos" if self.ignore_eos else "min_tokens"
            raise RequestError(
                f"{field} cannot be combined with structured outputs (the grammar decides where "
                "the "
                f"output ends); remove {field}",
                param=field,
            )
        bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        if bias and (bad := max(bias)) >= vocab_size:
            raise RequestError(
                f"logit_bias token id {bad} is out of range: the model's vocabulary has "
                f"{vocab_size} "
                f"tokens (ids 0..{vocab_size - 1})",
                param="logit_bias",
            )
        if self.min_tokens > max_tokens:
            raise RequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens}); lower "
                "min_tokens",
                param="min_tokens",
            )
        stop_ids = list(self.stop_token_ids or ())
        if not self.ignore_eos:
            stop_ids += eos_token_ids
        temperature = 1.0 if self.temperature is None else self.temperature
        if (
            temperature < SAMPLING_EPS
        ):  # greedy, as vLLM takes it (dividing by it made the logits infinite)
            temperature = 0.0
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
            min_p=0.0 if greedy or self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=tuple(bias.items()),
            logprobs=self.logprobs_asked,
            prompt_logprobs=self.prompt_logprobs_asked,
            guided=guided,
        )


class ChatTemplateInput:
    """What a chat template takes from a request body with `messages` (list[ChatMessage]) and
    `tools` (list[Tool] | None) fields: chat completions, /tokenize."""

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as dicts for tokenizer.apply_chat_template."""
        return template_messages([m.openai_dict() for m in self.messages])

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's shape), or None when there are none."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class ChatCompletionRequest(ChatTemplateInput, SamplingRequest):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)

    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    # Not implemented, as in SamplingRequest.
    functions: Annotated[Any, unsupported([])] = (
        None  # OpenAI's deprecated form of tools: send tools
    )
    function_call: Annotated[Any, unsupported("none", "auto")] = None
    echo: Annotated[Any, unsupported(False)] = None
    add_generation_prompt: Annotated[Any, unsupported(True)] = None
    continue_final_message: Annotated[Any, unsupported(False)] = None
    chat_template: Annotated[Any, unsupported()] = None
    # the chat template's further arguments (enable_thinking), over --default-chat-template-kwargs
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("at least one message is required")
        return messages

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError(
                "needs logprobs set to true; set logprobs to true or remove top_logprobs"
            )
        return top

    @field_validator("tool_choice")
    @classmethod
    def _with_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools")
        if choice not in (None, "none") and not tools:
            raise ValueError(
                "needs tools; send the tools the model may call, or remove tool_choice"
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
            t.function.name for t in tools
        }:
            raise ValueError(
                f"names the function {choice.function.name!r}, which is not among tools"
            )
        return choice

    @property
    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """none, auto, required or a named function; OpenAI's default is auto with tools and none
        without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens (OpenAI's older name); None if neither."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


def chat_request_as(fields: dict[str, Any], names: dict[str, str]) -> ChatCompletionRequest:
    """The chat completions request another API's body runs as (the Responses and Messages APIs),
    validated; an error names the field by that API's name (names: chat field -> its name), as its
    client sent it."""
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}
        )
    except ValidationError as exc:
        message, param = validation_error_message(exc)
        field = (param or "messages").split(".")[0]
        ours = names.get(field, field)
        raise RequestError(message.replace(field, ours, 1), param=ours) from None


class CompletionRequest(SamplingRequest):
    """Body of POST /v1/completions: one prompt, as text or as token ids."""

    prompt: str | list[int]
    max_tokens: int | None = Field(
        DEFAULT_COMPLETION_MAX_TOKENS, ge=0
    )  # 0 only with echo: score the prompt

    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(
        False, validate_default=True
    )  # the prompt comes back before the completion, with its logprobs when logprobs is set

    # Not implemented, as in SamplingRequest.
    suffix: Annotated[Any, unsupported("")] = None
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

    @field_validator("echo")
    @classmethod
    def _zero_tokens_with_echo(cls, echo: bool, info: ValidationInfo) -> bool:
        if info.data.get("max_tokens") == 0 and not echo:
            raise ValueError(
                "max_tokens 0 asks for the prompt alone, which needs echo; set echo to true or "
                "raise "
                "max_tokens to at least 1"
            )
        return echo

    @property
    def logprobs_asked(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_asked(self) -> int | None:
        shown = [
            n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None
        ]
        return max(shown) if shown else None

    @property
    def score_only(self) -> bool:
        """max_tokens 0 with echo: the prompt and its logprobs, no completion (the engine still
        samples one token, which is dropped)."""
        return self.echo and self.max_tokens == 0

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and best_of != info.data.get("n", 1):
            raise ValueError("not supported by this server unless equal to n; remove it")
        return best_of
