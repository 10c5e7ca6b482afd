"""`ppd serve` as a drop-in for `vllm serve`: its command line (MODEL as an argument, vLLM's flags
taken with their meaning or refused saying what ppd does instead, a hub id refused with how to get
the folder), the sampling defaults of --generation-config, several served names, /version, /ping,
GET /v1/models/{id}, and unknown request fields.

The API is driven in-process (no worker): a stand-in engine client records the sampling each request
gets."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest

import server.plan
from engine.config import ModelConfig, resolve_dtype
from engine.demo import demo_model_path
from server.api import VERSION, HttpOptions, build_app
from server.args import add_serve_args
from server.engine_client import Delta
from server.guard import Guard
from server.plan import UsageError
from server.protocol import IGNORED_FIELDS
from server.request_path import ServedModel
from server.serve import load_tokenizer


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(list(argv))


def plan(*argv: str) -> server.plan.ServePlan:
    found = server.plan.plan_serve(serve_args(*argv))
    shutil.rmtree(found.ipc_dir)
    return found


# ---- the command line ----------------------------------------------------------------------------


def test_the_model_as_an_argument_is_the_model_option(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    shutil.copytree(demo_model_path(), folder)
    by_argument, by_option = plan(str(folder)), plan("--model", str(folder))
    assert (
        by_argument.model_path == by_option.model_path == str(folder)
        and by_argument.model_name == "my-model"
    )
    assert plan().model_name == "demo", "no model at all: the demo, as before"
    with pytest.raises(UsageError, match="two models"):
        plan(str(folder), "--model", "demo")


def test_a_hub_id_is_refused_with_how_to_get_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    with pytest.raises(
        UsageError,
        match=r"downloads nothing.*hf download HuggingFaceTB/SmolLM2-135M-Instruct "
        r"--local-dir DIR.*ppd serve smollm2",
    ):
        plan("HuggingFaceTB/SmolLM2-135M-Instruct")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--no-enable-prefix-caching"], "always caches prefixes"),
        (["-tp", "3"], "does not split this model .* use one of 1, 2, 4, 8"),
        (["-pp", "2"], "tensor parallelism only"),
        (["--quantization", "awq"], "--quantization awq: ppd serves fp8"),
        (["--kv-cache-dtype", "fp8_e5m2"], "e4m3 .fp8, fp8_e4m3.; e5m2 is not served"),
        (["-q", "fp8", "--attention-backend", "cpu"], "through --attention-backend torch"),
        (["--max-logprobs", "50"], "0 to 20 logprobs"),
        (["--data-parallel-size", "2", "--units", "1"], "the same setting"),
    ],
)
def test_a_vllm_flag_ppd_does_not_take_is_refused_saying_what_it_does(
    argv: list[str], says: str
) -> None:
    with pytest.raises(UsageError, match=says):
        plan(*argv)


def test_vllm_flags_ppd_takes_start_the_same_server() -> None:
    accepted = plan(
        "--enable-prefix-caching",
        "--enable-auto-tool-choice",
        "--disable-log-requests",
        "--trust-remote-code",
        "--uvicorn-log-level",
        "warning",
        "-tp",
        "1",
        "-dp",
        "1",
        "--served-model-name",
        "a",
        "b",
    )
    assert (
        len(accepted.units) == 1
        and accepted.model_names == ("a", "b")
        and accepted.model_name == "a"
    )
    assert plan("-tp", "2").units[0].tensor_parallel_size == 2


def test_fp8_flags_reach_the_engine_and_the_pool_counts_a_byte_a_value() -> None:
    """--quantization fp8 and --kv-cache-dtype fp8 as vLLM takes them: the workers get both, the
    CPU serves them through the torch backend, and the same KV memory holds as many more blocks as
    the model's dtype has bytes a value."""
    plain = plan("--kv-cache-memory", "0.01").units[0].engine
    fp8 = plan("-q", "fp8", "--kv-cache-dtype", "fp8", "--kv-cache-memory", "0.01").units[0].engine
    assert (fp8.quantization, fp8.kv_cache_dtype, fp8.attention_backend) == ("fp8", "fp8", "torch")
    itemsize = resolve_dtype(plain.dtype, ModelConfig.from_folder(plain.model), "cpu").itemsize
    assert plain.num_kv_blocks is not None and fp8.num_kv_blocks is not None
    assert abs(fp8.num_kv_blocks - itemsize * plain.num_kv_blocks) <= itemsize


def test_generation_config_gives_the_defaults_of_requests_that_leave_them_unset(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.3,
                "top_p": 0.8,
                "top_k": 20,
                "max_new_tokens": 7,
                "do_sample": True,
                "eos_token_id": 2,
            }
        )
    )
    assert plan("--generation-config", str(folder)).sampling_defaults == {
        "temperature": 0.3,
        "top_p": 0.8,
        "top_k": 20,
        "max_tokens": 7,
    }
    assert plan("--generation-config", "vllm").sampling_defaults == {}
    overridden = plan(
        "--generation-config", str(folder), "--override-generation-config", '{"temperature": 0.1}'
    )
    assert (
        overridden.sampling_defaults["temperature"] == 0.1
        and overridden.sampling_defaults["top_p"] == 0.8
    )
    with pytest.raises(UsageError, match="no generation_config.json there"):
        plan("--generation-config", str(tmp_path))
    with pytest.raises(UsageError, match="not temprature"):
        plan("--override-generation-config", '{"temprature": 0.1}')


def test_a_chat_template_file_or_text_replaces_the_tokenizers(tmp_path: Path) -> None:
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert plan("--chat-template", str(tmp_path / "t.jinja")).chat_template == template
    assert plan("--chat-template", template).chat_template == template
    tokenizer = load_tokenizer(str(demo_model_path()), template)
    assert (
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<hi>"
    )
    with pytest.raises(UsageError, match="neither a readable file"):
        plan("--chat-template", str(tmp_path / "missing.jinja"))


# ---- the API -------------------------------------------------------------------------------------


class RecordingClient:
    """The engine client's face to the API: every request gets `answer` (the demo's byte tokens) and
    its prompt and sampling are kept."""

    api_server = 0
    units = [0]
    problems: dict[str, str] = {}
    retention_on = False

    def __init__(self, answer: bytes = b"ok") -> None:
        self.answer, self.prompts, self.sampling = answer, [], []
        self.metrics = type("M", (), {"render": staticmethod(lambda: b"")})()

    def refusal(self):
        return None

    async def generate(
        self, prompt_ids, sampling, session=None, route_hint=None, unit=None, retain_s=0.0
    ):
        self.prompts.append(prompt_ids)
        self.sampling.append(sampling)
        yield Delta(list(self.answer), "stop", route="decode", num_cached_tokens=0)


def api(
    ready: bool = True, template: str | None = None, answer: bytes = b"ok", **served
) -> tuple[httpx.AsyncClient, RecordingClient]:
    folder = demo_model_path()
    tokenizer = load_tokenizer(str(folder), template)
    model = ServedModel("a", str(folder), tokenizer, 4096, 320, (257,), **served)
    client = RecordingClient(answer)
    app = build_app(model, client, lambda: [{"ready": ready}])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ppd"), client


def chat(**fields) -> dict:
    return {"model": "a", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_sampling_defaults_fill_only_what_a_request_leaves_unset() -> None:
    async def run() -> list:
        http, client = api(sampling_defaults={"temperature": 0.2, "top_p": 0.9, "max_tokens": 1000})
        async with http:
            for body in (chat(), chat(temperature=1.0, max_tokens=3)):
                assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        return client.sampling

    defaulted, given = asyncio.run(run())
    assert (defaulted.temperature, defaulted.top_p) == (0.2, 0.9)
    assert defaulted.max_tokens == 1000, "the server's default, where the request sets none"
    assert (given.temperature, given.top_p, given.max_tokens) == (1.0, 0.9, 3)


def test_several_served_names_version_ping_and_one_model_by_id() -> None:
    async def run() -> dict:
        http, client = api(aliases=("a", "b"), max_logprobs=2)
        async with http:
            return {
                "models": (await http.get("/v1/models")).json(),
                "b": (await http.get("/v1/models/b")).json(),
                "missing": await http.get("/v1/models/c"),
                "chat b": (await http.post("/v1/chat/completions", json=chat(model="b"))).json(),
                "version": (await http.get("/version")).json(),
                "ping": (await http.get("/ping")).status_code,
                "post ping": (await http.post("/ping")).status_code,
                "logprobs": await http.post(
                    "/v1/chat/completions", json=chat(logprobs=True, top_logprobs=3)
                ),
            }

    got = asyncio.run(run())
    assert [m["id"] for m in got["models"]["data"]] == ["a", "b"] and got["b"]["id"] == "b"
    assert (
        got["missing"].status_code == 404
        and "`a`, `b`" in got["missing"].json()["error"]["message"]
    )
    assert got["chat b"]["model"] == "a", "answers carry the first name, as vLLM's do"
    assert got["version"] == {"version": VERSION} and got["ping"] == got["post ping"] == 200
    assert (
        got["logprobs"].status_code == 400 and "at most 2 (--max-logprobs)" in got["logprobs"].text
    )


def test_ping_is_503_until_the_units_are_ready() -> None:
    async def run() -> int:
        http, _ = api(ready=False)
        async with http:
            return (await http.get("/ping")).status_code

    assert asyncio.run(run()) == 503


def test_an_unknown_request_field_is_ignored_and_named_once_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    IGNORED_FIELDS.discard("max_token")

    async def run() -> list[int]:
        http, client = api()
        async with http:
            return [
                (await http.post("/v1/chat/completions", json=chat(max_token=5))).status_code
                for _ in range(3)
            ]

    with caplog.at_level("WARNING", logger="ppd.api"):
        assert asyncio.run(run()) == [200, 200, 200]
    assert [r.getMessage() for r in caplog.records if "max_token" in r.getMessage()] == [
        "a request's field 'max_token' is not one this server knows: ignored (said once per field "
        "name)"
    ]


PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + (m['content'] or '') + '<|end|>' "
    "}}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_tool_choice_auto_on_a_template_that_writes_no_tools() -> None:
    """Such a template neither shows the model the tools nor a call format: the tools are described
    in the system message in Hermes's format, and calls read in it, so an agent runs (every later
    turn sends auto) without a restart with --tool-call-parser."""
    weather = {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }

    async def run() -> tuple[dict, list[int]]:
        http, client = api(
            template=PLAIN_TEMPLATE,
            answer=(
                b'<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            ),
        )
        async with http:
            answer = await http.post(
                "/v1/chat/completions",
                json=chat(
                    tools=[weather],
                    messages=[
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Paris?"},
                    ],
                ),
            )
            return answer.json(), client.prompts[0]

    answer, prompt = asyncio.run(run())
    text = load_tokenizer(str(demo_model_path())).decode(prompt)
    assert (
        text.startswith("<|system|>Be brief.\n\n# Tools")
        and '"name": "weather"' in text
        and "<tool_call>" in text
    )
    assert text.endswith("<|user|>Paris?<|end|><|assistant|>"), (
        "the user's turn as the template writes it"
    )
    (call,) = answer["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert answer["choices"][0]["finish_reason"] == "tool_calls"


def test_a_refused_tool_choice_under_messages_is_named_in_anthropics_terms() -> None:
    """With --tool-call-parser none, auto is refused; under /v1/messages the fix is named as
    Anthropic's clients send it ({"type": "any"}, {"type": "tool", ...}), not as chat completions'
    "required"."""
    tool = {"name": "weather", "input_schema": {"type": "object"}}

    async def run() -> dict:
        http, _ = api(tool_parser="none")
        async with http:
            answer = await http.post(
                "/v1/messages",
                json={
                    "model": "a",
                    "max_tokens": 8,
                    "tools": [tool],
                    "tool_choice": {"type": "auto"},
                    "messages": [{"role": "user", "content": "hi"}],
                },
            )
            assert answer.status_code == 400
            return answer.json()

    message = asyncio.run(run())["error"]["message"]
    assert 'tool_choice {"type": "any"}' in message and '{"type": "tool", "name": ...}' in message
    assert '"required"' not in message and "named function" not in message


def test_unknown_field_names_a_client_invents_are_named_only_up_to_a_bound(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import server.protocol

    monkeypatch.setattr(server.protocol, "IGNORED_FIELDS", set())
    with caplog.at_level("WARNING", logger="ppd.api"):
        for i in range(server.protocol.MAX_IGNORED_NAMED + 50):
            server.protocol.ChatCompletionRequest.model_validate(chat(**{f"x{i}": 1}))
    named = [
        r.getMessage() for r in caplog.records if "is not one this server knows" in r.getMessage()
    ]
    assert len(named) == len(server.protocol.IGNORED_FIELDS) == server.protocol.MAX_IGNORED_NAMED
    assert named[-1].endswith("no more are named)")


def test_model_may_be_left_out_and_served_names_are_the_only_names() -> None:
    """As vLLM: `model` may be left out (the one model serves it, answers carry its name); with
    --served-model-name only the served names are names (paths=()), without it the model's path is
    one too."""

    async def run(**served) -> dict:
        http, _ = api(**served)
        async with http:
            bodies = {
                "none": {"messages": [{"role": "user", "content": "hi"}]},
                "path": chat(model=str(demo_model_path())),
            }
            got = {k: await http.post("/v1/chat/completions", json=b) for k, b in bodies.items()}
            got["stream"] = await http.post(
                "/v1/chat/completions", json={**bodies["none"], "stream": True}
            )
            got["completion"] = await http.post("/v1/completions", json={"prompt": "hi"})
            return got

    plain = asyncio.run(run())
    assert plain["none"].status_code == 200 and plain["none"].json()["model"] == "a"
    assert plain["completion"].status_code == 200 and plain["completion"].json()["model"] == "a"
    chunks = [
        json.loads(line.removeprefix("data: "))
        for line in plain["stream"].text.splitlines()
        if line.startswith("data: {")
    ]
    assert chunks and all(c["model"] == "a" for c in chunks)
    assert plain["path"].status_code == 200  # no --served-model-name: the path names it too
    named = asyncio.run(run(aliases=("a", "b"), paths=()))
    assert named["none"].status_code == 200
    assert named["path"].status_code == 404 and "`a`, `b`" in named["path"].text


def test_vllms_api_key_variable_sets_the_key_unless_another_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from server.serve import request_guard

    monkeypatch.delenv("PPD_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert request_guard(serve_args()).api_keys == ("from-vllm",)
    monkeypatch.setenv("PPD_API_KEY", "from-ppd")
    assert request_guard(serve_args()).api_keys == ("from-ppd",)
    assert request_guard(serve_args("--api-key", "flag")).api_keys == ("flag",)
    assert request_guard(serve_args("--api-key", "one", "two")).api_keys == ("one", "two")


def test_a_prompt_too_long_alone_is_blamed_not_max_tokens() -> None:
    """A prompt that alone fills the 4,096-token context names the prompt (`messages` or `prompt`);
    one that fits but leaves less room than max_tokens asks names max_tokens and the room left."""

    async def run() -> dict:
        http, _ = api()
        long = "word " * 5000
        async with http:
            return {
                "chat": await http.post(
                    "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": long}])
                ),
                "completion": await http.post("/v1/completions", json={"prompt": long}),
                "max_tokens": await http.post("/v1/chat/completions", json=chat(max_tokens=5000)),
            }

    got = asyncio.run(run())
    for name, param in (("chat", "messages"), ("completion", "prompt")):
        error = got[name].json()["error"]
        assert got[name].status_code == 400 and error["param"] == param, error
        assert "your prompt is" in error["message"] and "max_tokens" not in error["message"]
    error = got["max_tokens"].json()["error"]
    assert got["max_tokens"].status_code == 400 and error["param"] == "max_tokens"
    assert "lower max_tokens to" in error["message"]


def test_vllms_http_flags_docs_cors_request_ids_role_and_forced_usage() -> None:
    """--disable-fastapi-docs, the CORS flags, --enable-request-id-headers, --response-role and
    --enable-force-include-usage, as build_app and the chat answers take them."""
    folder = demo_model_path()
    model = ServedModel(
        "a",
        str(folder),
        load_tokenizer(str(folder)),
        4096,
        320,
        (257,),
        response_role="bot",
        force_usage=True,
    )
    cors = dict(
        allow_origins=["https://app.example"],
        allow_methods=["*"],
        allow_headers=["*"],
        allow_credentials=False,
    )
    app = build_app(
        model,
        RecordingClient(),
        lambda: [{"ready": True}],
        guard=Guard(api_keys=("k",)),
        http=HttpOptions(docs=False, cors=cors, request_id_headers=True),
    )

    async def run() -> dict:
        auth = {"authorization": "Bearer k"}
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://ppd"
        ) as http:
            return {
                "docs": await http.get("/docs", headers=auth),
                "preflight": await http.options(
                    "/v1/chat/completions",
                    headers={
                        "origin": "https://app.example",
                        "access-control-request-method": "POST",
                    },
                ),
                "whole": await http.post(
                    "/v1/chat/completions", json=chat(), headers={**auth, "x-request-id": "r-1"}
                ),
                "stream": await http.post(
                    "/v1/chat/completions", json=chat(stream=True), headers=auth
                ),
            }

    got = asyncio.run(run())
    assert got["docs"].status_code == 404
    assert got["preflight"].status_code == 200, "a browser's preflight needs no API key"
    assert got["preflight"].headers["access-control-allow-origin"] == "https://app.example"
    assert got["whole"].headers["x-request-id"] == "r-1"
    assert len(got["stream"].headers["x-request-id"]) == 32
    assert got["whole"].json()["choices"][0]["message"]["role"] == "bot"
    chunks = [
        json.loads(line.removeprefix("data: "))
        for line in got["stream"].text.splitlines()
        if line.startswith("data: {")
    ]
    assert chunks[0]["choices"][0]["delta"]["role"] == "bot"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


def test_chat_template_kwargs_over_the_servers_defaults_reach_the_template() -> None:
    """chat_template_kwargs (and /tokenize's) over --default-chat-template-kwargs, passed to the
    template as its variables; the arguments the server sets itself cannot be given."""
    template = (
        "{{ 'T' if enable_thinking is not defined or enable_thinking else 'N' }}"
        "{{ messages[0]['content'] }}"
    )

    async def run() -> dict:
        http, client = api(template=template, template_kwargs={"enable_thinking": False})
        async with http:
            replies = {
                "default": await http.post("/v1/chat/completions", json=chat()),
                "asked": await http.post(
                    "/v1/chat/completions",
                    json=chat(chat_template_kwargs={"enable_thinking": True}),
                ),
                "reserved": await http.post(
                    "/v1/chat/completions", json=chat(chat_template_kwargs={"tools": []})
                ),
                "tokenize": await http.post(
                    "/tokenize",
                    json={**chat(), "chat_template_kwargs": {"enable_thinking": True}},
                ),
            }
        return {"replies": replies, "prompts": client.prompts}

    got = asyncio.run(run())
    tokenizer = load_tokenizer(str(demo_model_path()))
    assert [tokenizer.decode(p) for p in got["prompts"]] == ["Nhi", "Thi"]
    reserved = got["replies"]["reserved"]
    assert reserved.status_code == 400 and "may not set tools" in reserved.text
    assert tokenizer.decode(got["replies"]["tokenize"].json()["tokens"]) == "Thi"


def test_a_bad_tokenize_body_names_its_field_not_pydantics_union() -> None:
    async def run() -> list:
        http, _ = api()
        async with http:
            return [
                (await http.post("/tokenize", json=body)).json()["error"]
                for body in ({}, {"messages": "x"}, {"prompt": {"a": 1}})
            ]

    missing, messages, prompt = asyncio.run(run())
    assert missing["message"] == "prompt: Field required" and missing["param"] == "prompt"
    assert messages["param"] == "messages" and messages["message"].startswith("messages: ")
    assert prompt["param"] == "prompt"
    assert not any(
        "[" in e["message"] or "Request" in e["message"] for e in (missing, messages, prompt)
    )


def test_too_many_workers_for_the_cores_advise_what_helps(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """More worker processes than cores: fewer units where one unit fits, else a smaller -tp."""
    monkeypatch.setattr(server.plan, "available_cores", lambda: [0, 1])
    with caplog.at_level("WARNING", logger="ppd"):
        plan("-tp", "4")
    assert "use -tp 2 or less on this machine" in caplog.text and "--units" not in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="ppd"):
        plan("-tp", "2", "--units", "2")
    assert "use --units 1 or fewer" in caplog.text


def test_the_chat_flags_reach_the_served_model() -> None:
    """--reasoning-parser, --response-role, --enable-force-include-usage and
    --default-chat-template-kwargs as `ppd serve` hands them to the API."""
    from server.serve import served_model

    argv = (
        "--reasoning-parser",
        "qwen3",
        "--response-role",
        "bot",
        "--enable-force-include-usage",
        "--default-chat-template-kwargs",
        '{"enable_thinking": false}',
    )
    args = serve_args(*argv)
    found = server.plan.plan_serve(args)
    shutil.rmtree(found.ipc_dir)
    client = type("Client", (), {"on_ready": None})()
    model = served_model(args, found, load_tokenizer(found.tokenizer_path), client, None)
    assert (model.reasoning_parser, model.response_role, model.force_usage) == (
        "qwen3",
        "bot",
        True,
    )
    assert model.template_kwargs == {"enable_thinking": False}
    with pytest.raises(UsageError, match="give a JSON object"):
        served_model(serve_args("--default-chat-template-kwargs", "[1]"), found, None, client, None)
