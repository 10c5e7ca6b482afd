"""Reasoning models under --reasoning-parser: the thinking apart from the answer in chat completions
(reasoning_content, streamed as deltas), the Responses API (a reasoning item) and /v1/messages
(a thinking block), through the openai and anthropic SDKs; enable_thinking off; tool calls read
from the answer after the thinking.

The API runs in-process on a tiny Qwen3 folder whose chat template thinks as Qwen3's does; a
stand-in engine client streams a scripted output one token a step, so the splits across chunk
boundaries are exercised."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest

from engine.demo import write_byte_tokenizer
from server.api import build_app
from server.engine_client import Delta
from server.reasoning import ReasoningSplitter, reasoning_token_count, whole
from server.request_path import ServedModel
from server.serve import load_tokenizer
from tests.server.test_vllm_drop_in import RecordingClient
from tests.tiny_models import write_tiny_model

# Qwen3's generation prompt and its handling of thinking (the tail of Qwen3-8B's template): the
# model thinks unless enable_thinking is false, when the template writes an empty thinking block.
QWEN3_THINKING = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
THOUGHT = "\nThe user greets me; answer briefly.\n"
ANSWER = "Hello there."


class ScriptedClient(RecordingClient):
    """test_vllm_drop_in's stand-in client (it keeps the prompts), its answer streamed a token (a
    byte of the byte-level tokenizer) a step, with the router's block size /v1/messages reads."""

    router = type("Router", (), {"block_size": 16})()

    def __init__(self, output: str) -> None:
        super().__init__(output.encode())

    async def generate(
        self, prompt_ids, sampling, session=None, route_hint=None, unit=None, retain_s=0.0
    ):
        self.prompts.append(prompt_ids)
        for i, byte in enumerate(self.answer):
            last = i == len(self.answer) - 1
            yield Delta([byte], "stop" if last else None, route="decode", num_cached_tokens=0)


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_tiny_model(tmp_path_factory.mktemp("qwen3-thinking"), "qwen3")
    write_byte_tokenizer(folder)
    return folder


def app_for(folder: Path, output: str, parser: str | None = "qwen3"):
    tokenizer = load_tokenizer(str(folder), QWEN3_THINKING)
    model = ServedModel(
        "qwen3", str(folder), tokenizer, 4096, 320, (257,), "hermes", reasoning_parser=parser
    )
    client = ScriptedClient(output)
    return build_app(model, client, lambda: [{"ready": True}]), client


def transport(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ppd/v1")


@pytest.mark.parametrize("opening", ["<think>", ""])
def test_splits_whole_and_streamed_at_every_cut_agree(opening: str) -> None:
    """The template may write <think> into the prompt (the output then starts inside the thinking):
    either way, the split is the same fed whole or in two pieces cut anywhere, a tag cut too."""
    text = f"{opening}{THOUGHT}</think>\n\n{ANSWER}"
    assert whole(text, True) == (THOUGHT, ANSWER)
    for cut in range(len(text) + 1):
        splitter = ReasoningSplitter(True)
        parts = [splitter.feed(text[:cut]), splitter.feed(text[cut:], final=True)]
        assert "".join(p.reasoning for p in parts) == THOUGHT
        assert "".join(p.content for p in parts) == ANSWER
    assert whole(f"{THOUGHT} and more", True) == (f"{THOUGHT} and more", ""), "never closed"
    assert whole(text, False) == (None, text), "not thinking: all of it is answer"


def test_chat_completions_through_the_openai_sdk(qwen3_folder: Path) -> None:
    app, client = app_for(qwen3_folder, f"<think>{THOUGHT}</think>\n\n{ANSWER}")

    async def run() -> dict:
        async with transport(app) as http:
            sdk = openai.AsyncOpenAI(api_key="x", base_url="http://ppd/v1", http_client=http)
            messages = [{"role": "user", "content": "hi"}]
            whole_ = await sdk.chat.completions.create(model="qwen3", messages=messages)
            stream = await sdk.chat.completions.create(
                model="qwen3", messages=messages, stream=True
            )
            deltas = [c.choices[0].delta async for c in stream if c.choices]
            return {"whole": whole_, "deltas": deltas}

    got = asyncio.run(run())
    message = got["whole"].choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == THOUGHT
    assert message.model_extra["reasoning"] == THOUGHT
    thought = "".join(d.model_extra.get("reasoning_content") or "" for d in got["deltas"])
    answer = "".join(d.content or "" for d in got["deltas"])
    assert (thought, answer) == (THOUGHT, ANSWER)
    assert len([d for d in got["deltas"] if d.model_extra.get("reasoning_content")]) > 5
    prompt = load_tokenizer(str(qwen3_folder)).decode(client.prompts[0])
    assert prompt.endswith("<|im_start|>assistant\n"), "the template lets the model think"


def test_enable_thinking_false_reaches_the_template_and_all_is_answer(qwen3_folder: Path) -> None:
    app, client = app_for(qwen3_folder, ANSWER)

    async def run():
        async with transport(app) as http:
            sdk = openai.AsyncOpenAI(api_key="x", base_url="http://ppd/v1", http_client=http)
            return await sdk.chat.completions.create(
                model="qwen3",
                messages=[{"role": "user", "content": "hi"}],
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )

    message = asyncio.run(run()).choices[0].message
    assert message.content == ANSWER and message.model_extra["reasoning_content"] is None
    prompt = load_tokenizer(str(qwen3_folder)).decode(client.prompts[0])
    assert prompt.endswith("<think>\n\n</think>\n\n")


def test_tool_calls_are_read_from_the_answer_after_the_thinking(qwen3_folder: Path) -> None:
    """A thought that mentions a tool call's markup is thinking, not a call; the call after
    </think> is."""
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    output = (
        "<think>I could write <tool_call>{}</tool_call> here</think>\n\n"
        f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    )
    app, _ = app_for(qwen3_folder, output)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]

    async def run():
        async with transport(app) as http:
            sdk = openai.AsyncOpenAI(api_key="x", base_url="http://ppd/v1", http_client=http)
            body = dict(model="qwen3", messages=[{"role": "user", "content": "hi"}], tools=tools)
            whole_ = await sdk.chat.completions.create(**body)
            stream = await sdk.chat.completions.create(**body, stream=True)
            return whole_, [c async for c in stream]

    whole_, chunks = asyncio.run(run())
    choice = whole_.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert "<tool_call>{}" in choice.message.model_extra["reasoning_content"]
    streamed = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [tc.function.name for tc in streamed if tc.function.name] == ["get_weather"]


def test_responses_api_gives_a_reasoning_item(qwen3_folder: Path) -> None:
    app, _ = app_for(qwen3_folder, f"{THOUGHT}</think>\n\n{ANSWER}")

    async def run():
        async with transport(app) as http:
            sdk = openai.AsyncOpenAI(api_key="x", base_url="http://ppd/v1", http_client=http)
            whole_ = await sdk.responses.create(model="qwen3", input="hi", store=False)
            events = [
                e
                async for e in await sdk.responses.create(
                    model="qwen3", input="hi", store=False, stream=True
                )
            ]
            return whole_, events

    whole_, events = asyncio.run(run())
    assert [item.type for item in whole_.output] == ["reasoning", "message"]
    assert whole_.output[0].content[0].text == THOUGHT and whole_.output_text == ANSWER
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == THOUGHT
    final = next(e for e in events if e.type == "response.completed").response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == ANSWER
    # the byte-level tokenizer: a token a byte, the closing tag's eight included
    thinking = len(f"{THOUGHT}</think>".encode())
    assert whole_.usage.output_tokens_details.reasoning_tokens == thinking
    assert final.usage.output_tokens_details.reasoning_tokens == thinking


def test_reasoning_tokens_where_the_closing_tag_is_one_token_or_never_comes(
    qwen3_folder: Path,
) -> None:
    """Qwen3's and DeepSeek-R1's vocabularies have `</think>` as one token: the thinking runs to it.
    An output that never closes its thinking is all thinking."""

    class OneTokenTag:
        unk_token_id = 0

        def convert_tokens_to_ids(self, token: str) -> int:
            return 99 if token == "</think>" else 0

    assert reasoning_token_count(OneTokenTag(), [5, 6, 7, 99, 10, 11]) == 4
    tokenizer = load_tokenizer(str(qwen3_folder))
    ids = tokenizer.encode(f"{THOUGHT} and on", add_special_tokens=False)
    assert reasoning_token_count(tokenizer, ids) == len(ids)
    ids = tokenizer.encode(f"x</think>{ANSWER}", add_special_tokens=False)
    assert reasoning_token_count(tokenizer, ids) == len(b"x</think>")


def test_messages_api_gives_a_thinking_block(qwen3_folder: Path) -> None:
    # the test extra has the anthropic SDK; a GPU host's software need not (this module is
    # collected there by `pytest -m gpu`)
    anthropic = pytest.importorskip("anthropic")
    httpx2 = pytest.importorskip("httpx2")
    app, client = app_for(qwen3_folder, f"<think>{THOUGHT}</think>\n\n{ANSWER}")

    async def run():
        # the anthropic SDK brings its own fork of httpx
        async with httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=app), base_url="http://ppd"
        ) as http:
            sdk = anthropic.AsyncAnthropic(api_key="x", base_url="http://ppd", http_client=http)
            body = dict(
                model="qwen3",
                max_tokens=200,
                messages=[
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "thinking", "thinking": "earlier", "signature": ""},
                            {"type": "text", "text": "Hi."},
                        ],
                    },
                    {"role": "user", "content": "hello"},
                ],
            )
            whole_ = await sdk.messages.create(**body)
            async with sdk.messages.stream(**body) as stream:
                streamed = await stream.get_final_message()
            off = await sdk.messages.create(**body, thinking={"type": "disabled"})
            return whole_, streamed, off

    whole_, streamed, _ = asyncio.run(run())
    for message in (whole_, streamed):
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == THOUGHT and message.content[1].text == ANSWER
    tokenizer = load_tokenizer(str(qwen3_folder))
    assert tokenizer.decode(client.prompts[-1]).endswith("<think>\n\n</think>\n\n")
    assert not tokenizer.decode(client.prompts[0]).endswith("</think>\n\n")


def test_without_a_parser_the_thinking_stays_in_the_content(qwen3_folder: Path) -> None:
    output = f"<think>{THOUGHT}</think>\n\n{ANSWER}"
    app, _ = app_for(qwen3_folder, output, parser=None)

    async def run():
        async with transport(app) as http:
            return (
                await http.post(
                    "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                )
            ).json()

    message = asyncio.run(run())["choices"][0]["message"]
    assert message["content"] == output and "reasoning_content" not in message


def test_reasoning_items_sent_back_reach_the_template_with_the_answer() -> None:
    from server.responses_protocol import input_messages

    items = [
        {"type": "message", "role": "user", "content": "hi"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "greet back"}],
        },
        {"type": "message", "role": "assistant", "content": "Hello."},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "look"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    ]
    messages = input_messages(items)
    assert messages[1] == {
        "role": "assistant",
        "content": "Hello.",
        "reasoning_content": "greet back",
    }
    assert messages[2]["tool_calls"][0]["id"] == "c1" and messages[2]["reasoning_content"] == "look"
