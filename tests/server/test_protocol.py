"""Request validation: what parses, what is refused, and with which message."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from engine.sampling_params import GuidedSpec
from server.errors import RequestError, error_body, validation_error_message
from server.protocol import ChatCompletionRequest, CompletionRequest

EOS = (261, 257)
VOCAB = 320


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "demo", "prompt": "Once upon", **fields})


def chat_error(**fields: Any) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        chat(**fields)
    return validation_error_message(info.value)


def completion_error(**fields: Any) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        completion(**fields)
    return validation_error_message(info.value)


def test_minimal_chat_request_has_openai_defaults() -> None:
    request = chat()
    assert request.n == 1 and request.stream is False and not request.include_usage
    assert request.stop_strings == () and request.requested_max_tokens is None
    params = request.sampling_params(max_tokens=100, eos_token_ids=EOS, vocab_size=VOCAB)
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.top_k == 0
    assert params.max_tokens == 100 and params.min_tokens == 0 and params.seed is None
    assert set(params.stop_token_ids) == set(EOS) and not params.ignore_eos


def test_full_chat_request_parses() -> None:
    request = chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
            },
            {"role": "assistant", "content": "Hello", "name": "bot"},
            {"role": "user", "content": "Bye"},
        ],
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        max_tokens=50,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
        stop=["\n\n", "END"],
        seed=7,
        min_tokens=2,
        return_token_ids=True,
        user="someone",
        some_future_field={"ignored": True},
    )
    assert request.include_usage and request.return_token_ids
    assert request.stop_strings == ("\n\n", "END")
    assert request.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi\nthere"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    params = request.sampling_params(max_tokens=50, eos_token_ids=EOS, vocab_size=VOCAB)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.9, 40, 7)
    assert params.min_tokens == 2


def runs_as(request: ChatCompletionRequest | CompletionRequest) -> tuple:
    """Everything the server takes from a parsed request to run it: two requests that agree here are
    served alike."""
    shared = (
        request.sampling_params(8, EOS, VOCAB),
        request.guided_spec(),
        request.stop_strings,
        request.requested_max_tokens,
        request.n,
        request.include_usage,
        request.return_token_ids,
    )
    if isinstance(request, CompletionRequest):
        return (*shared, request.prompt, request.echo, request.score_only)
    return (
        *shared,
        request.template_messages(),
        request.template_tools(),
        request.effective_tool_choice,
        request.parallel_tool_calls,
    )


# Each field at the value that asks for nothing: the unsupported ones (refused at any other value,
# see test_unsupported_*_features_are_refused_by_name) and the supported ones at their "off" value.
NO_OP_CHAT_FIELDS = [
    {"logprobs": False, "top_logprobs": 0},
    {"presence_penalty": 0},
    {"frequency_penalty": 0.0},
    {"repetition_penalty": 1},
    {"logit_bias": {}},
    {"tools": []},
    {"tool_choice": "none"},
    {"response_format": {"type": "text"}},
    {"echo": False},
    {"use_beam_search": False},
    {"include_stop_str_in_output": False},
    {"skip_special_tokens": True},
    {"functions": []},
    {"function_call": "none"},
    {"add_generation_prompt": True},
    {"continue_final_message": False},
    {"chat_template_kwargs": {}},
]
NO_OP_COMPLETION_FIELDS = [{"echo": False}, {"suffix": ""}, {"best_of": 1}, {"logprobs": None}]


@pytest.mark.parametrize("fields", NO_OP_CHAT_FIELDS, ids=lambda f: ",".join(f))
def test_no_op_values_of_unsupported_fields_are_accepted(fields: dict[str, Any]) -> None:
    """A client that sends a field at its "ask for nothing" value gets the request it would get
    without the field: not a 400, and not a different run."""
    assert runs_as(chat(**fields)) == runs_as(chat())


@pytest.mark.parametrize("fields", NO_OP_COMPLETION_FIELDS, ids=lambda f: ",".join(f))
def test_no_op_values_of_unsupported_completion_fields_are_accepted(fields: dict[str, Any]) -> None:
    assert runs_as(completion(**fields)) == runs_as(completion())


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert chat(max_tokens=10, max_completion_tokens=20).requested_max_tokens == 20
    assert chat(max_tokens=10).requested_max_tokens == 10


def test_completions_default_to_16_tokens_like_openai() -> None:
    assert completion().requested_max_tokens == 16
    assert completion(max_tokens=None).requested_max_tokens is None


def test_temperature_zero_is_greedy_and_drops_top_p_top_k() -> None:
    params = chat(temperature=0, top_p=0.5, top_k=5).sampling_params(
        max_tokens=8, eos_token_ids=EOS, vocab_size=VOCAB
    )
    assert params.greedy and params.top_p == 1.0 and params.top_k == 0


def test_top_k_minus_one_means_off() -> None:
    assert (
        chat(top_k=-1).sampling_params(max_tokens=8, eos_token_ids=EOS, vocab_size=VOCAB).top_k == 0
    )


def test_stop_token_ids_join_eos_unless_ignore_eos() -> None:
    params = chat(stop_token_ids=[5, 6]).sampling_params(
        max_tokens=8, eos_token_ids=EOS, vocab_size=VOCAB
    )
    assert set(params.stop_token_ids) == {5, 6, *EOS}
    ignoring = chat(stop_token_ids=[5], ignore_eos=True).sampling_params(
        max_tokens=8, eos_token_ids=EOS, vocab_size=VOCAB
    )
    assert ignoring.stop_token_ids == (5,) and ignoring.ignore_eos
    # An id given twice is listed once.
    assert len(chat(stop_token_ids=[261]).sampling_params(8, EOS, VOCAB).stop_token_ids) == 2


def test_min_tokens_above_the_resolved_budget_is_refused() -> None:
    with pytest.raises(RequestError) as info:
        chat(min_tokens=10).sampling_params(max_tokens=5, eos_token_ids=EOS, vocab_size=VOCAB)
    assert info.value.status == 400 and info.value.param == "min_tokens"
    assert "min_tokens" in info.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"n": 0}, "n"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [1, -3]}, "stop_token_ids.1"),
        ({"seed": 2**64}, "seed"),
        ({"stream": "sometimes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": 5}, "model"),  # a name or nothing (vLLM: the one model)
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
    ],
)
def test_invalid_field_is_named(fields: dict[str, Any], param: str) -> None:
    message, got_param = chat_error(**fields)
    assert got_param == param
    assert message.startswith(f"{param}: ")


def test_n_is_capped_with_a_hint() -> None:
    message, param = chat_error(n=1000)
    assert param == "n" and "at most 16" in message


def test_non_text_content_is_refused_clearly() -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    message, param = chat_error(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, image]}]
    )
    assert param == "messages.0.content"
    assert "only text content is supported" in message and "image_url" in message


@pytest.mark.parametrize(
    "fields",
    [
        {"echo": True},
        {"use_beam_search": True},
        {"chat_template": "{{ messages }}"},
        {"functions": [{"name": "f"}]},
    ],
)
def test_unsupported_chat_features_are_refused_by_name(fields: dict[str, Any]) -> None:
    (name,) = fields
    message, param = chat_error(**fields)
    assert param == name
    assert message.startswith(f"{name}: ") and "not supported" in message


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"top_logprobs": 3}, "top_logprobs", "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
            "not among tools",
        ),
        ({"logit_bias": {"a": 1}}, "logit_bias", "token ids"),
        ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ],
)
def test_bad_values_of_supported_fields_are_refused_by_name(
    fields: dict[str, Any], param: str, words: str
) -> None:
    message, got = chat_error(**fields)
    assert got == param and words in message, message


def test_new_features_map_to_sampling_params() -> None:
    params = chat(
        logprobs=True,
        top_logprobs=4,
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.2,
        min_p=0.1,
        logit_bias={"50": 10},
    ).sampling_params(8, EOS, VOCAB)
    assert (
        params.logprobs,
        params.presence_penalty,
        params.frequency_penalty,
        params.repetition_penalty,
        params.min_p,
        params.logit_bias,
    ) == (4, 0.5, -1, 1.2, 0.1, ((50, 10.0),))
    assert chat(logprobs=True).sampling_params(8, EOS, VOCAB).logprobs == 0
    assert chat().sampling_params(8, EOS, VOCAB).logprobs is None
    assert completion(logprobs=2).sampling_params(8, EOS, VOCAB).logprobs == 2


def test_one_structured_output_constraint_per_request() -> None:
    spec, field = chat(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object"}},
        }
    ).guided_spec()
    assert (spec.kind, json.loads(spec.value), field) == (
        "json_schema",
        {"type": "object"},
        "response_format",
    )
    assert chat(guided_choice=["a", "b"]).guided_spec()[0] == GuidedSpec("choice", '["a", "b"]')
    assert chat(structured_outputs={"regex": "[0-9]+"}).guided_spec() == (
        GuidedSpec("regex", "[0-9]+"),
        "structured_outputs.regex",
    )
    assert chat(response_format={"type": "text"}).guided_spec() is None
    with pytest.raises(RequestError, match="guided_regex both constrain"):
        chat(response_format={"type": "json_object"}, guided_regex="a").guided_spec()
    with pytest.raises(RequestError, match="ignore_eos cannot be combined"):
        chat(ignore_eos=True).sampling_params(8, EOS, VOCAB, GuidedSpec("json_object"))


def test_tool_calls_in_history_are_accepted_from_the_assistant_only() -> None:
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    request = chat(
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "1", "content": "42"},
        ]
    )
    assert request.template_messages()[1]["tool_calls"][0]["function"]["name"] == "f"
    message, param = chat_error(messages=[{"role": "user", "content": "", "tool_calls": [call]}])
    assert param == "messages.0.tool_calls" and "only assistant messages" in message


def test_echo_and_prompt_logprobs_map_to_the_engine() -> None:
    assert completion(echo=True, logprobs=2).sampling_params(8, EOS, VOCAB).prompt_logprobs == 2
    assert (
        completion(echo=True, logprobs=2, prompt_logprobs=5)
        .sampling_params(8, EOS, VOCAB)
        .prompt_logprobs
        == 5
    )
    assert (
        completion(echo=True).sampling_params(8, EOS, VOCAB).prompt_logprobs is None
    )  # the text alone
    assert completion(logprobs=2).sampling_params(8, EOS, VOCAB).prompt_logprobs is None
    assert completion(echo=True, max_tokens=0).score_only
    message, param = completion_error(max_tokens=0)
    assert param == "echo" and "needs echo" in message


@pytest.mark.parametrize("fields", [{"suffix": "end"}, {"best_of": 3}])
def test_unsupported_completion_features_are_refused_by_name(fields: dict[str, Any]) -> None:
    (name,) = fields
    message, param = completion_error(**fields)
    assert param == name and "not supported" in message


def test_completion_prompt_is_text_or_token_ids() -> None:
    assert completion(prompt="abc").prompt == "abc"
    assert completion(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert completion(prompt=["abc"]).prompt == "abc"  # a batch of one is one prompt
    assert completion(prompt=[[4, 5]]).prompt == [4, 5]


@pytest.mark.parametrize("prompt", ["", [], [[]], [""]])
def test_empty_prompt_is_refused(prompt: Any) -> None:
    message, param = completion_error(prompt=prompt)
    assert param == "prompt" and "empty" in message


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2, 3]]])
def test_batched_prompts_are_refused_with_a_hint(prompt: Any) -> None:
    message, param = completion_error(prompt=prompt)
    assert param == "prompt" and "one prompt per request" in message


@pytest.mark.parametrize("prompt", [[1, -2], [1, 2.5], [True, 1], 42])
def test_bad_token_id_prompts_are_refused(prompt: Any) -> None:
    _, param = completion_error(prompt=prompt)
    assert param == "prompt"


def test_several_errors_are_reported_together() -> None:
    message, param = chat_error(temperature=5, top_p=0)
    assert param == "temperature"
    assert "temperature: " in message and "top_p: " in message


def test_fastapi_errors_lose_their_body_prefix() -> None:
    exc = RequestValidationError(
        [{"type": "missing", "loc": ("body", "messages"), "msg": "Field required", "input": {}}]
    )
    assert validation_error_message(exc) == ("messages: Field required", "messages")
    bad_json = RequestValidationError(
        [
            {
                "type": "json_invalid",
                "loc": ("body", 7),
                "msg": "JSON decode error",
                "ctx": {"error": "Expecting value"},
            }
        ]
    )
    message, param = validation_error_message(bad_json)
    assert "not valid JSON" in message and "Expecting value" in message and param is None
    no_body = RequestValidationError(
        [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
    )
    message, param = validation_error_message(no_body)
    assert "JSON body" in message and param is None


def test_error_body_and_request_error_follow_vllm() -> None:
    assert error_body("boom", "BadRequestError", "n", 400) == {
        "error": {"message": "boom", "type": "BadRequestError", "param": "n", "code": 400}
    }
    for status, kind in [
        (400, "BadRequestError"),
        (404, "NotFoundError"),
        (503, "ServiceUnavailableError"),
    ]:
        error = RequestError("x", status=status)
        assert (error.type, error.code, error.status) == (kind, status, status)
        assert error.body()["error"]["type"] == kind
