"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request runs as the chat completions request it amounts to (its input items as messages, its
tools, text.format and sampling fields), through the shared request path; its answer comes back as
output items (a message, function calls), or streamed as the typed events in OpenAI's order with
sequence numbers. A stored response (`store`, the default) keeps its exact token ids: a later
request naming it as previous_response_id runs them again followed by only its new input's tokens
(server/conversation.py), so its cached prefix is the whole previous turn. The router places a
request on the unit holding the most of its blocks, so a conversation stays where its KV is.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from server.conversation import continued_prompt, first_prompt, system_messages
from server.errors import RequestError, escaped
from server.output_blocks import Block, BlockEvent, OutputBlocks, blocks_of
from server.protocol import chat_request_as
from server.reasoning import reasoning_token_count
from server.request_path import Generation, RequestPath
from server.request_types import Choice, Event, Prompt
from server.response_store import ResponseStore, StoredResponse
from server.responses_protocol import ResponsesRequest, input_messages

_json = msgspec.json.Encoder()

# With previous_response_id: token-ids (the stored ids kept) or rendered (the conversation
# re-tokenized).
HISTORY_HEADER = "x-ppd-history"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def add_responses_routes(app: FastAPI, path: RequestPath, store: ResponseStore) -> None:
    model = path.model
    store_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ppd-store")

    async def in_store(fn, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(store_pool, fn, *args)

    async def stored(response_id: str, param: str) -> StoredResponse:
        found = await in_store(store.get, response_id)
        if found is None:
            raise RequestError(
                f"Response with id '{response_id}' not found: it was never stored (store: false), "
                "was "
                "deleted, or was evicted (--response-store-max-bytes)",
                status=404,
                param=param,
            )
        return found

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return Response(
            _json.encode((await stored(response_id, "response_id")).response),
            media_type="application/json",
        )

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        if not await in_store(store.delete, response_id):
            await stored(response_id, "response_id")  # raises the 404
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        model.check_model(body.model)
        model.need_chat_template()
        new = input_messages(body.input)
        prev = (
            await stored(body.previous_response_id, "previous_response_id")
            if body.previous_response_id
            else None
        )
        history = (prev.history + [prev.assistant] if prev else []) + new
        chat = chat_request_as(
            {**body.chat_fields(), "messages": system_messages(body.instructions) + history},
            {
                "messages": "input",
                "max_completion_tokens": "max_output_tokens",
                "response_format": "text.format",
            },
        )
        tools = chat.template_tools()
        kwargs = model.chat_template_kwargs(None)  # --default-chat-template-kwargs
        headers = {}
        try:
            if prev is None:
                prompt_ids = await path.off_loop(
                    first_prompt, model.tokenizer, body.instructions, new, tools, kwargs
                )
            else:
                prompt_ids, kept = await path.off_loop(
                    continued_prompt, model.tokenizer, prev, body.instructions, new, tools, kwargs
                )
                headers[HISTORY_HEADER] = "token-ids" if kept else "rendered"
        except (
            Exception
        ) as exc:  # the template refused the conversation (a role order it does not take, ...)
            raise RequestError(
                f"the chat template rejected the conversation: {exc}", param="input"
            ) from exc
        gen = await path.start(chat, Prompt(prompt_ids), request)
        run = ResponseRun(new_id("resp"), body, model.name, gen, model.tokenizer)
        if body.store:
            run.save = lambda final: in_store(store.put, run.stored(history, tools, final))
        return await path.respond(gen, request, run, headers)


class ResponseRun:
    """One response as it is generated (server/answer.py's Answer): its output items, its object,
    its stream of events (created, in_progress, each output item's events, then completed or
    incomplete). With save set (store), it is stored before its last event goes out, so a client
    may continue from it as soon as it has it."""

    def __init__(
        self,
        response_id: str,
        body: ResponsesRequest,
        model_name: str,
        gen: Generation,
        tokenizer: Any = None,
    ) -> None:
        self.id, self.body, self.model_name, self.gen = response_id, body, model_name, gen
        self.tokenizer = tokenizer  # counts a reasoning model's thinking tokens
        self.choice: Choice = gen.choices[0]
        self.created = int(time.time())
        self.blocks: list[Block] = []
        self.streamed = OutputBlocks(self.choice)  # a stream's blocks as they come
        self.item_ids: dict[int, str] = {}  # block index -> output item id
        self.seq = 0
        self.save: Callable[[dict[str, Any]], Awaitable[Any]] | None = None

    async def whole(self) -> dict[str, Any]:
        self.blocks = blocks_of(self.choice)
        final = self.response()
        if self.save is not None:
            await self.save(final)
        return final

    def item_id(self, block: Block) -> str:
        if block.index not in self.item_ids:
            prefix = {"text": "msg", "reasoning": "rs", "tool_call": "fc"}[block.kind]
            self.item_ids[block.index] = new_id(prefix)
        return self.item_ids[block.index]

    def item(self, block: Block, status: str = "completed") -> dict[str, Any]:
        if block.kind == "reasoning":  # a reasoning model's thinking (--reasoning-parser)
            return {
                "type": "reasoning",
                "id": self.item_id(block),
                "summary": [],
                "content": [] if status == "in_progress" else [reasoning_text(block.text)],
                "status": status,
            }
        if block.kind == "text":
            content = [] if status == "in_progress" else [output_text(block.text)]
            return {
                "type": "message",
                "id": self.item_id(block),
                "status": status,
                "role": "assistant",
                "content": content,
            }
        return {
            "type": "function_call",
            "id": self.item_id(block),
            "call_id": block.call_id,
            "name": block.name,
            "arguments": "" if status == "in_progress" else block.text,
            "status": status,
        }

    def reasoning_tokens(self, blocks: list[Block]) -> int:
        """The output's thinking tokens, where it had any (--reasoning-parser)."""
        if self.tokenizer is None or not any(b.kind == "reasoning" for b in blocks):
            return 0
        return reasoning_token_count(self.tokenizer, self.choice.token_ids)

    @property
    def incomplete(self) -> bool:
        return self.choice.finish_reason == "length"

    def response(self, status: str | None = None) -> dict[str, Any]:
        """The response object; status: as it stands (in_progress) or, by default, as it ended."""
        body = self.body
        done = status is None
        if done:
            status = "incomplete" if self.incomplete else "completed"
        output = []
        if done:
            blocks = self.blocks or [Block("text", 0)]  # an empty answer is still a message
            output = [
                self.item(b, "incomplete" if self.incomplete else "completed") for b in blocks
            ]
        fmt = (
            body.text.format.model_dump(by_alias=True, exclude_none=True)
            if body.text and body.text.format
            else {"type": "text"}
        )
        c = self.choice
        usage = None
        if done:
            num_prompt, num_output = len(self.gen.prompt.token_ids), len(c.token_ids)
            usage = {
                "input_tokens": num_prompt,
                "input_tokens_details": {"cached_tokens": c.num_cached},
                "output_tokens": num_output,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(blocks)},
                "total_tokens": num_prompt + num_output,
            }
            if self.gen.retention is not None:
                usage["ppd_cache_retention"] = self.gen.retention
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "completed_at": int(time.time()) if done and not self.incomplete else None,
            "model": self.model_name,
            "output": output,
            "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"}
            if done and self.incomplete
            else None,
            "error": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "store": body.store,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": True
            if body.parallel_tool_calls is None
            else body.parallel_tool_calls,
            "text": {"format": fmt},
            "metadata": body.metadata or {},
            "truncation": "disabled",
            "background": False,
            "reasoning": None,
            "user": body.user,
            "service_tier": "default",
        }

    def stored(
        self,
        history: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        final: dict[str, Any],
    ) -> StoredResponse:
        """This finished response (final: its object, as sent) as the store keeps it, with the chat
        history its prompt stood for."""
        texts = [b.text for b in self.blocks if b.kind == "text"]
        calls = [
            {"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
            for b in self.blocks
            if b.kind == "tool_call"
        ]
        assistant: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(texts) if texts or not calls else None,
        }
        if calls:
            assistant["tool_calls"] = calls
        return StoredResponse(
            self.id,
            final,
            self.body.instructions,
            history,
            tools,
            list(self.gen.prompt.token_ids),
            list(self.choice.token_ids),
            assistant,
            exact=not self.choice.detok.stopped,
        )

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json.encode(data) + b"\n\n"

    def block_events(self, e: BlockEvent) -> list[bytes]:
        b = e.block
        where = {"item_id": self.item_id(b), "output_index": b.index}
        if b.kind == "reasoning":
            part = {"content_index": 0}
            if e.what == "start":
                added = self.item(b, "in_progress")
                return [self.event("response.output_item.added", output_index=b.index, item=added)]
            if e.what == "delta":
                return [self.event("response.reasoning_text.delta", **where, **part, delta=e.delta)]
            return [
                self.event("response.reasoning_text.done", **where, **part, text=b.text),
                self.event("response.output_item.done", output_index=b.index, item=self.item(b)),
            ]
        if b.kind == "text":
            part = {"content_index": 0}
            if e.what == "start":
                added = self.item(b, "in_progress")
                return [
                    self.event("response.output_item.added", output_index=b.index, item=added),
                    self.event(
                        "response.content_part.added", **where, **part, part=output_text("")
                    ),
                ]
            if e.what == "delta":
                return [
                    self.event(
                        "response.output_text.delta", **where, **part, delta=e.delta, logprobs=[]
                    )
                ]
            return [
                self.event("response.output_text.done", **where, **part, text=b.text, logprobs=[]),
                self.event("response.content_part.done", **where, **part, part=output_text(b.text)),
                self.event("response.output_item.done", output_index=b.index, item=self.item(b)),
            ]
        if e.what == "start":
            return [
                self.event(
                    "response.output_item.added",
                    output_index=b.index,
                    item=self.item(b, "in_progress"),
                )
            ]
        if e.what == "delta":
            return [self.event("response.function_call_arguments.delta", **where, delta=e.delta)]
        return [
            self.event(
                "response.function_call_arguments.done", **where, name=b.name, arguments=b.text
            ),
            self.event("response.output_item.done", output_index=b.index, item=self.item(b)),
        ]

    def opening(self) -> list[bytes]:
        return [
            self.event("response.created", response=self.response("in_progress")),
            self.event("response.in_progress", response=self.response("in_progress")),
        ]

    def chunks(self, event: Event) -> Iterator[bytes]:
        for e in self.streamed.feed(event.text, final=event.finish_reason is not None):
            yield from self.block_events(e)

    async def closing(self) -> AsyncIterator[bytes]:
        if not self.streamed.blocks:  # an empty answer is still a message
            empty = Block("text", 0)
            self.streamed.blocks.append(empty)
            for what in ("start", "stop"):
                for chunk in self.block_events(BlockEvent(what, empty)):
                    yield chunk
        self.blocks = self.streamed.blocks
        final = self.response()
        if self.save is not None:
            await self.save(final)
        yield self.event(
            "response.incomplete" if self.incomplete else "response.completed", response=final
        )

    def error(self, status: int, message: str) -> list[bytes]:
        return [self.event("error", code=str(status), message=escaped(message), param=None)]


def reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
