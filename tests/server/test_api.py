"""The HTTP API through the official openai client, against `ppd serve` with the demo model."""

from __future__ import annotations

import json
import re
import time

import httpx
import msgspec
import openai
import pytest
import zmq

from engine.kv_events import BlockHasher, BlockStored, KVEventBatch
from tests.server_process import ServerProcess, process_title


@pytest.fixture(scope="module")
def kv_events_endpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"ipc://{tmp_path_factory.mktemp('kv')}/events"


@pytest.fixture(scope="module")
def server(start_server, kv_events_endpoint: str) -> ServerProcess:
    events = {"enable_kv_cache_events": True, "endpoint": kv_events_endpoint}
    return start_server("--policy", "dlocal", "--kv-events-config", json.dumps(events))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, messages: list[dict], **kw):
    raw = client.chat.completions.with_raw_response.create(model="demo", messages=messages, **kw)
    return raw.parse(), raw.headers


def test_models_and_health(client: openai.OpenAI, server: ServerProcess) -> None:
    assert [m.id for m in client.models.list().data] == ["demo"]
    health = server.health()
    assert health["status"] == "ok"
    roles = {w["role"]: w for w in health["units"][0]["workers"]}
    assert set(roles) == {"decode", "prefill"}
    assert all(w["alive"] and w["pid"] > 0 for w in roles.values())
    # ps tells the processes apart.
    assert process_title(server.proc.pid).startswith("ppd::api-0")
    assert {process_title(w["pid"]) for w in roles.values()} == {
        "ppd::u0-decode",
        "ppd::u0-prefill",
    }
    assert health["units"][0]["device"] == {"kind": "cpu", "tensor_parallel_size": 1}


def test_chat_answers_with_route_and_usage(client: openai.OpenAI) -> None:
    resp, headers = chat(
        client,
        [{"role": "user", "content": "Hello!"}],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 12
    assert len(choice.model_extra["token_ids"]) == 12
    assert resp.usage.prompt_tokens == len(resp.model_extra["prompt_token_ids"])
    assert headers["x-ppd-route"] == "prefill"  # turn 1 always prefills on the prefill worker


def test_turn_two_reuses_cached_prefix_on_decode_route(client: openai.OpenAI) -> None:
    history = [{"role": "user", "content": "Tell me about caching. " * 8}]
    first, headers1 = chat(
        client, history, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Go on."},
    ]
    second, headers2 = chat(
        client, history, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The first turn's prompt is a prefix of the second's; whole blocks of it are reused.
    assert cached >= (first.usage.prompt_tokens // 16) * 16 > 0
    assert headers1["x-ppd-route"] == "prefill" and headers2["x-ppd-route"] == "decode"


def test_stream_with_usage_ends_with_usage_only_chunk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Stream please"}],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    full, _ = chat(
        client,
        [{"role": "user", "content": "Stream please"}],
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert streamed == full.choices[0].message.content


def test_completions_with_text_and_token_ids(client: openai.OpenAI) -> None:
    by_text = client.completions.create(
        model="demo",
        prompt="abc",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids = by_text.choices[0].model_extra["token_ids"]
    by_ids = client.completions.create(
        model="demo",
        prompt=[97, 98, 99],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert (
        by_ids.choices[0].model_extra["token_ids"] == ids
    )  # the byte tokenizer maps "abc" to 97, 98, 99
    assert by_text.usage.prompt_tokens == 3 and by_text.choices[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_n_choices(client: openai.OpenAI) -> None:
    kw = dict(
        max_tokens=16,
        temperature=1.0,
        seed=1234,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    a, _ = chat(client, [{"role": "user", "content": "random"}], **kw)
    b, _ = chat(client, [{"role": "user", "content": "random"}], **kw)
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    many, _ = chat(client, [{"role": "user", "content": "random"}], n=3, **kw)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert many.usage.completion_tokens == 48
    assert len({tuple(c.model_extra["token_ids"]) for c in many.choices}) > 1


def test_stop_string_ends_answer_before_it(client: openai.OpenAI) -> None:
    free, _ = chat(
        client,
        [{"role": "user", "content": "stop test"}],
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = free.choices[0].message.content
    stop = next(text[i : i + 2] for i in range(4, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    stopped, _ = chat(
        client,
        [{"role": "user", "content": "stop test"}],
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(stop)]


@pytest.mark.parametrize(
    "body, status, needle",
    [
        (
            {"model": "demo", "messages": [{"role": "user", "content": "x"}], "temperature": 5},
            400,
            "temperature",
        ),
        ({"model": "demo"}, 400, "messages"),
        ({"model": "demo", "messages": "hello"}, 400, "messages"),
        (
            {"model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            400,
            "max_tokens",
        ),
        (
            {"model": "demo", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
            400,
            "top_logprobs",
        ),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "nope"),
        (
            {"model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000},
            400,
            "maximum context length",
        ),
    ],
)
def test_chat_errors_use_openai_error_body(
    server: ServerProcess, body: dict, status: int, needle: str
) -> None:
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == status
    error = resp.json()["error"]
    assert needle in error["message"] + str(error["param"])
    assert set(error) == {"message", "type", "param", "code"}


def test_malformed_json_is_400(server: ServerProcess) -> None:
    resp = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b"{not json",
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 400
    assert "JSON" in resp.json()["error"]["message"]


def test_context_error_names_the_numbers(server: ServerProcess) -> None:
    resp = httpx.post(
        f"{server.url}/v1/completions",
        timeout=30,
        json={"model": "demo", "prompt": [1] * 100, "max_tokens": 5000},
    )
    msg = resp.json()["error"]["message"]
    assert resp.status_code == 400 and "4096" in msg and "100" in msg and "5000" in msg


def test_token_id_out_of_vocabulary_is_400(server: ServerProcess) -> None:
    resp = httpx.post(
        f"{server.url}/v1/completions", timeout=30, json={"model": "demo", "prompt": [1, 99999]}
    )
    assert resp.status_code == 400 and "99999" in resp.json()["error"]["message"]


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "x"}], top_p=0
        )


def test_metrics_use_vllm_names(server: ServerProcess, client: openai.OpenAI) -> None:
    chat(client, [{"role": "user", "content": "metrics"}], max_tokens=4)
    m = server.metrics()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "ppd:prefills_total",
        "ppd:route_decisions_total",
        "ppd:prefill_queue_tokens",
        "ppd:decode_step_seconds",
        "ppd:inline_tokens_per_second",
        "ppd:inline_expert_seconds",
    ):
        assert name in m, name
    assert (
        m["vllm:e2e_request_latency_seconds_count"] >= 1
        and m["vllm:prefix_cache_queries_total"] > 0
    )
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    assert 'ppd:route_decisions_total{model_name="demo",reason="miss",route="prefill"}' in text


def test_metrics_have_vllms_request_histograms_and_cache_info(server: ServerProcess) -> None:
    """What vLLM's dashboards plot per request (its phases and token counts), per step and of the
    cache, scraped from a server: a request of 5 prompt tokens and 6 generated ones lands in each
    phase histogram once."""
    names = (
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    )
    before = server.metrics()
    resp = httpx.post(
        f"{server.url}/v1/completions",
        timeout=30,
        json={"model": "demo", "prompt": [1, 2, 3, 4, 5], "max_tokens": 6, "ignore_eos": True},
    )
    assert resp.status_code == 200
    after = server.metrics()
    for name in names:
        assert after[f"{name}_count"] == before.get(f"{name}_count", 0) + 1, name
    assert (
        after["vllm:request_prompt_tokens_sum"] - before.get("vllm:request_prompt_tokens_sum", 0)
        == 5
    )
    assert (
        after["vllm:request_generation_tokens_sum"]
        - before.get("vllm:request_generation_tokens_sum", 0)
        == 6
    )
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    assert 'vllm:request_prompt_tokens_bucket{le="5.0",model_name="demo"}' in text, (
        "vLLM's 1-2-5 buckets"
    )
    assert re.search(
        r'vllm:cache_config_info\{[^}]*block_size="16"[^}]*enable_prefix_caching="True"[^}]*} 1\.0',
        text,
    )
    deadline = time.monotonic() + 5  # the worker's steps come with its next stats
    while server.metrics().get("vllm:iteration_tokens_total_count", 0) < after.get(
        "ppd:worker_steps_total", 1
    ):
        assert time.monotonic() < deadline, (
            "the decode worker's steps were not counted by token count"
        )
        time.sleep(0.1)


def test_metrics_count_the_decode_workers_steps_and_the_loop_around_them(
    server: ServerProcess,
) -> None:
    before = server.metrics()
    resp = httpx.post(
        f"{server.url}/v1/completions",
        timeout=30,
        json={"model": "demo", "prompt": [1, 2, 3], "max_tokens": 12, "ignore_eos": True},
    )
    assert resp.status_code == 200
    deadline = time.monotonic() + 5
    while (after := server.metrics())["ppd:worker_steps_total"] < before.get(
        "ppd:worker_steps_total", 0
    ) + 11:
        assert time.monotonic() < deadline, "the worker's steps were not counted"
        time.sleep(0.1)
    # At least one step per token after the first, each timed, and some host time around them.
    assert after["ppd:worker_step_seconds_total"] > before.get("ppd:worker_step_seconds_total", 0)
    assert after["ppd:worker_loop_seconds_total"] > before.get("ppd:worker_loop_seconds_total", 0)


def test_route_header_names_a_route_or_is_refused(server: ServerProcess) -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    resp = httpx.post(
        f"{server.url}/v1/chat/completions", json=body, headers={"x-ppd-route": "gpu"}, timeout=30
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "x-ppd-route"
    assert "prefill or decode" in resp.json()["error"]["message"]


def test_stream_with_several_choices_interleaves_them(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "two"}],
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=7,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids: dict[int, list[int]] = {0: [], 1: []}
    finished = {}
    for chunk in stream:
        for choice in chunk.choices:
            ids[choice.index] += choice.model_extra.get("token_ids") or []
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length"}
    assert len(ids[0]) == len(ids[1]) == 6


def test_completions_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kw = dict(
        model="demo", prompt="The sea", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kw)
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices
    )
    assert streamed == full.choices[0].text and full.choices[0].finish_reason == "length"


def test_tokenize_render_and_detokenize_give_what_chat_runs(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    """vLLM's token endpoints, which routers use to hash a request's blocks: the ids are those the
    chat runs."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Count to three."},
    ]
    resp, _ = chat(client, messages, max_tokens=2, extra_body={"return_token_ids": True})
    ran = resp.model_extra["prompt_token_ids"]
    tok = httpx.post(
        f"{server.url}/tokenize", json={"model": "demo", "messages": messages}, timeout=30
    ).json()
    assert tok["tokens"] == ran and tok["count"] == len(ran) and tok["max_model_len"] == 4096
    render = httpx.post(
        f"{server.url}/v1/chat/completions/render",
        timeout=30,
        json={"model": "demo", "messages": messages, "max_tokens": 7},
    ).json()
    assert render["token_ids"] == ran and render["sampling_params"]["max_tokens"] == 7
    text = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "abc", "return_token_strs": True}, timeout=30
    ).json()
    done = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "demo", "prompt": "abc", "max_tokens": 1, "return_token_ids": True},
        timeout=30,
    ).json()
    assert text["tokens"] == done["prompt_token_ids"] and "".join(text["token_strs"]) == "abc"
    rendered = httpx.post(
        f"{server.url}/v1/completions/render", json={"model": "demo", "prompt": "abc"}, timeout=30
    ).json()
    assert [r["token_ids"] for r in rendered] == [done["prompt_token_ids"]]
    back = httpx.post(
        f"{server.url}/detokenize", json={"tokens": text["tokens"]}, timeout=30
    ).json()
    assert back == {"prompt": "abc"}


@pytest.mark.parametrize(
    "path, body, status, needle",
    [
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "nope"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"},
            400,
            "chat_template",
        ),
        ("/detokenize", {"tokens": [99999]}, 400, "99999"),
        ("/v1/chat/completions/render", {"model": "demo", "messages": []}, 400, "messages"),
    ],
)
def test_token_endpoint_errors(
    server: ServerProcess, path: str, body: dict, status: int, needle: str
) -> None:
    resp = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert resp.status_code == status
    error = resp.json()["error"]
    assert needle in error["message"] + str(error["param"])


def test_kv_events_report_the_prompts_blocks_with_vllms_hashes(
    server: ServerProcess, client: openai.OpenAI, kv_events_endpoint: str
) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(kv_events_endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        # PUB drops what it sends before the subscription reaches it: chats of their own, until
        # one's events arrive.
        deadline = time.monotonic() + 30
        probes = 0
        while not sub.poll(200 if probes else 0):
            assert time.monotonic() < deadline, (
                f"no KV event reached the subscriber in 30 s ({probes} chats)"
            )
            chat(
                client,
                [{"role": "user", "content": f"Subscribed yet? {probes} " * 4}],
                max_tokens=1,
            )
            probes += 1
        resp, _ = chat(
            client,
            [{"role": "user", "content": "Events, please. " * 6}],
            max_tokens=20,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        tokens = resp.model_extra["prompt_token_ids"] + resp.choices[0].model_extra["token_ids"]
        hasher = BlockHasher()
        want = [
            hasher.external(h) for h in hasher.chain(tokens[:-1], 16)
        ]  # the last token's KV is never written
        stored: list[
            int
        ] = []  # this prompt's blocks, as stored events report them (the probes' are left out)
        decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        deadline = time.monotonic() + 10
        while stored != want and time.monotonic() < deadline:
            if sub.poll(500):
                batch = decode(sub.recv_multipart()[-1])
                assert batch.data_parallel_rank == 0
                stored += [
                    h
                    for e in batch.events
                    if isinstance(e, BlockStored)
                    for h in e.block_hashes
                    if h in want
                ]
        assert stored == want and len(want) >= 6
    finally:
        sub.close(0)
        ctx.term()
