"""What a hostile or careless client can send, against `ppd serve` with the demo model: every answer
is a 200 or an OpenAI-shaped 4xx, no worker dies, and the server's own checks (API key, Host
header, body size) hold."""

from __future__ import annotations

import httpx
import pytest

from tests.server_process import ServerProcess

KEY = "sekret-key"
AUTH = {"authorization": f"Bearer {KEY}"}
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:
    return start_server("--policy", "dlocal", "--api-key", KEY, "--max-request-bytes", str(LIMIT))


def post(server: ServerProcess, path: str, body: dict | None = None, **kw) -> httpx.Response:
    headers = {**AUTH, **kw.pop("headers", {})}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60, **kw)


def assert_error(resp: httpx.Response, status: int, *needles: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    for needle in needles:
        assert needle in error["message"] + str(error["param"]), (needle, error)
    return error


def test_min_tokens_with_stop_token_ids_on_both_routes_keeps_the_workers(
    server: ServerProcess,
) -> None:
    # This request used to kill the prefill worker (and the decode worker when the prompt had a
    # cached prefix).
    pids = server.worker_pids()
    prompt = "a conversation that comes back " * 4
    for _ in range(
        2
    ):  # the second time, the prefix is cached and the append-prefill runs on the decode worker
        resp = post(
            server,
            "/v1/completions",
            {
                "model": "demo",
                "prompt": prompt,
                "max_tokens": 6,
                "min_tokens": 4,
                "stop_token_ids": [5, 97],
                "temperature": 0,
            },
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] >= 4
    assert resp.headers["x-ppd-route"] == "decode"
    assert server.worker_pids() == pids


@pytest.mark.parametrize(
    "extra, needles",
    [
        ({"stop_token_ids": [99999]}, ["99999", "stop_token_ids"]),
        ({"stop_token_ids": [2**70]}, ["stop_token_ids"]),
        ({"stop_token_ids": list(range(300))}, ["at most 256"]),
        ({"stop": [f"s{i}" for i in range(20)]}, ["at most 16"]),
        ({"stop": "x" * 2000}, ["at most 1024"]),
        ({"top_k": 2**70}, ["top_k"]),
        ({"max_tokens": 2**70}, ["max_tokens"]),
        ({"min_tokens": 2**70}, ["min_tokens"]),
        ({"seed": 2**70}, ["seed"]),
        ({"n": 10**6}, ["n"]),
    ],
)
def test_token_id_and_list_fields_out_of_range_are_400(
    server: ServerProcess, extra: dict, needles: list[str]
) -> None:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 4,
        **extra,
    }
    assert_error(post(server, "/v1/chat/completions", body), 400, *needles)


def test_prompt_token_ids_past_the_vocabulary_or_int64_are_400(server: ServerProcess) -> None:
    for bad in (99999, 2**70):
        assert_error(
            post(server, "/v1/completions", {"model": "demo", "prompt": [1, bad]}), 400, str(bad)
        )


def test_a_body_over_the_limit_is_413_before_parsing(server: ServerProcess) -> None:
    big = {"model": "demo", "messages": [{"role": "user", "content": "x" * (LIMIT + 10)}]}
    assert_error(post(server, "/v1/chat/completions", big), 413, "--max-request-bytes", str(LIMIT))

    def chunks():  # no Content-Length: the limit holds while the body arrives
        yield b'{"model": "demo", "prompt": "'
        for _ in range(LIMIT // 1024 + 2):
            yield b"y" * 1024
        yield b'"}'

    resp = httpx.post(
        f"{server.url}/v1/completions",
        content=chunks(),
        timeout=60,
        headers={**AUTH, "content-type": "application/json"},
    )
    assert_error(resp, 413, "--max-request-bytes")
    small = post(
        server, "/v1/completions", {"model": "demo", "prompt": "y" * 1000, "max_tokens": 2}
    )
    assert small.status_code == 200


def test_api_key_is_required_except_for_health_and_metrics(server: ServerProcess) -> None:
    body = {"model": "demo", "prompt": "hi", "max_tokens": 2}
    missing = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert_error(missing, 401, "no API key", "Bearer")
    wrong = httpx.post(
        f"{server.url}/v1/completions",
        json=body,
        timeout=30,
        headers={"authorization": "Bearer nope"},
    )
    assert_error(wrong, 401, "wrong API key")
    assert_error(httpx.get(f"{server.url}/v1/models", timeout=30), 401)
    assert post(server, "/v1/completions", body).status_code == 200
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 200


def test_models_show_the_served_name_not_the_path(server: ServerProcess) -> None:
    (entry,) = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=30).json()["data"]
    assert entry["id"] == entry["root"] == "demo"
    assert "/" not in str(entry)


def test_a_foreign_host_header_is_refused(server: ServerProcess) -> None:
    body = {"model": "demo", "prompt": "hi", "max_tokens": 2}
    # A page on evil.example whose name was rebound to 127.0.0.1 sends its own name as Host.
    assert_error(
        post(server, "/v1/completions", body, headers={"host": "evil.example"}), 400, "evil.example"
    )
    port = server.url.rsplit(":", 1)[1]
    assert (
        post(server, "/v1/completions", body, headers={"host": f"localhost:{port}"}).status_code
        == 200
    )


# a server of its own, about 20 s on 2 cores: in the second suite, under the default one's budget
@pytest.mark.slow
def test_chat_without_a_template_says_so(tmp_path, start_server) -> None:
    import json

    from engine.demo import write_byte_tokenizer
    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / "tiny", "llama")
    write_byte_tokenizer(folder, 320)  # then without its chat template
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tiny = start_server("--model", str(folder), "--num-kv-blocks", "64")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    resp = httpx.post(f"{tiny.url}/v1/chat/completions", json=body, timeout=30)
    assert_error(resp, 400, "no chat template", "/v1/completions")
    ok = httpx.post(
        f"{tiny.url}/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
        timeout=30,
    )
    assert ok.status_code == 200
