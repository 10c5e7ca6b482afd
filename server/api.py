"""The OpenAI-compatible HTTP API: chat and text completions, models, health, metrics.

A request is tokenized here (chat template), checked against the model, split
into its n choices, and each choice streamed from the engine client through an
incremental detokenizer. Every response says where its prefill ran
(x-ppd-route). A client that disconnects aborts its choices, which frees their
KV blocks in the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.guided import spec_problem
from engine.sampling_params import GuidedSpec, SamplingParams
from server.detokenizer import make_detokenizer
from server.engine_client import EngineClient, EngineError
from server.errors import RequestError, error_body, error_type, validation_error_message
from server.guard import Guard, GuardMiddleware
from server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from server.responses import (Choice, Event, Prompt, TokenText, choice_body, prompt_logprobs_body, stream_events,
                              usage)
from server.tokenize_api import add_token_routes
from server.tool_output import ToolOutput, tool_output_for

log = logging.getLogger("ppd.api")

ROUTE_HEADER = "x-ppd-route"  # on a response: where the prefill ran; on a request: where to run an append-prefill
API_SERVER_HEADER = "x-ppd-api-server"  # on a response: which API-server process served it (--api-server-count)
SESSION_HEADER = "x-session-id"  # keeps a conversation on one unit
RANK_HEADER = "x-data-parallel-rank"  # vLLM's: the unit (data-parallel rank) an outside router chose
_json = msgspec.json.Encoder()


@dataclass
class ServedModel:
    """What the API needs to know of the model it serves."""

    name: str
    path: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tool_parser: str = "auto"  # --tool-call-parser: how tool_choice auto reads calls out of the model's text
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.token_text = TokenText(self.tokenizer)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.name, self.path):
            raise RequestError(f"The model `{name}` does not exist; this server serves `{self.name}`", status=404,
                               param="model")

    def need_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise RequestError("this server runs without a tokenizer (--skip-tokenizer-init): send the prompt as a "
                               "list of token ids to /v1/completions", param=param)

    def need_chat_template(self) -> None:
        self.need_tokenizer("messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(f"the model {self.name} has no chat template (its tokenizer_config.json has none): use "
                               "/v1/completions with a prompt, or serve a tokenizer that has one (--tokenizer)",
                               param="messages")

    def chat_prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        add_special_tokens: bool = False) -> list[int]:
        """The token ids the chat template makes of messages (what /v1/chat/completions runs)."""
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message, tokenize=False)
        except Exception as exc:  # a template may raise on any input it dislikes (role order, ...)
            raise RequestError(f"the chat template rejected the messages: {exc}", param="messages") from exc
        return self.encode(text, "messages", add_special_tokens=add_special_tokens)

    def encode(self, text: str, param: str, **kw: Any) -> list[int]:
        try:
            return self.tokenizer.encode(text, **kw)
        except Exception as exc:  # e.g. a lone surrogate, which JSON allows and UTF-8 does not
            raise RequestError(f"the text cannot be tokenized ({type(exc).__name__}: {exc}); send valid Unicode",
                               param=param) from exc

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        if token_ids and (bad := max(token_ids)) >= self.vocab_size:
            raise RequestError(f"token id {bad} is out of range: the model's vocabulary has {self.vocab_size} "
                               f"tokens (ids 0..{self.vocab_size - 1})", param=param)

    def resolve_max_tokens(self, body: SamplingRequest, num_prompt: int) -> int:
        room = self.max_model_len - num_prompt
        requested = body.requested_max_tokens
        if room < 1 or (requested is not None and requested > room):
            asked = f"{num_prompt + requested} tokens ({num_prompt} in the prompt, {requested} in the completion)" \
                if requested is not None else f"{num_prompt} tokens in the prompt, leaving no room for the completion"
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                               f"requested {asked}. Shorten the prompt or lower max_tokens.", param="max_tokens")
        return requested if requested is not None else room


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type(status), param, status), status_code=status)


def build_app(model: ServedModel, client: EngineClient, health: Callable[[], dict], lifespan=None,
              guard: Guard = Guard()) -> FastAPI:
    """The FastAPI app. health() returns the units' worker states for GET /health."""
    app = FastAPI(title="ppd-serve", lifespan=lifespan)
    app.add_middleware(GuardMiddleware, guard=guard, refuse=client.refusal)
    # Tokenizing and templating a long prompt takes milliseconds to seconds: off the event loop, which streams
    # every other client's tokens. One thread: a tokenizer object is not meant to be used by two at once.
    text_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ppd-tokenize")

    async def off_loop(fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(text_pool, fn, *args)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_error_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(RequestError)
    async def _bad_request(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        response = error_response(exc.status, exc.message)
        if exc.retry_after is not None:
            response.headers["retry-after"] = str(int(exc.retry_after))
        return response

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # A bug of ours, not the client's: logged with its traceback, answered in OpenAI's shape.
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error ({type(exc).__name__}); the server logged it")

    @app.get("/health")
    async def get_health() -> JSONResponse:
        units = health()
        ok = bool(units) and all(u["ready"] for u in units)
        # Overloaded is still healthy (200): a probe that restarted the server now would lose every request.
        status = "unavailable" if not ok else ("overloaded" if all(u.get("overloaded") for u in units) else "ok")
        return JSONResponse({"status": status, "units": units}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(client.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": model.created,
                                            "owned_by": "ppd-serve", "root": model.name, "max_model_len": model.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await respond(body, Prompt(await chat_prompt(body)), request, chat=True)

    async def chat_prompt(body: ChatCompletionRequest) -> list[int]:
        model.check_model(body.model)
        model.need_chat_template()
        return await off_loop(model.chat_prompt_ids, body.template_messages(), body.template_tools())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        echo = None
        prompt_ids = await completion_prompt(body)
        if body.echo:
            model.need_tokenizer("echo")
            echo = body.prompt if isinstance(body.prompt, str) else await off_loop(model.tokenizer.decode, prompt_ids)
        return await respond(body, Prompt(prompt_ids, echo), request, chat=False)

    async def completion_prompt(body: CompletionRequest) -> list[int]:
        model.check_model(body.model)
        if isinstance(body.prompt, str):
            model.need_tokenizer("prompt")
            return await off_loop(model.encode, body.prompt, "prompt")
        model.check_token_ids(body.prompt, "prompt")
        return body.prompt

    add_token_routes(app, model, off_loop, chat_prompt, completion_prompt)

    def output_rules(body: SamplingRequest) -> tuple[GuidedSpec | None, ToolOutput | None]:
        """The constraint on the output (structured outputs, or a tool choice that forces calls) and how tool calls
        are read from the text, checked: a spec the grammar library cannot build is the client's error (400)."""
        tools = tool_output_for(body, model.tokenizer, model.tool_parser) if isinstance(body, ChatCompletionRequest) \
            else None
        asked = body.guided_spec()
        if tools is not None and tools.spec is not None and asked is not None:
            raise RequestError(f"tool_choice {tools.mode} already constrains the output to tool calls; remove "
                               f"{asked[1]}", param=asked[1])
        spec, field = (tools.spec, "tools") if tools is not None and tools.spec is not None else (asked or (None, None))
        if spec is None:
            return None, tools
        if model.tokenizer is None:
            raise RequestError("structured outputs need a tokenizer, and this server runs without one "
                               "(--skip-tokenizer-init)", param=field)
        if (problem := spec_problem(spec)) is not None:
            raise RequestError(f"{field}: {problem}", param=field)
        return spec, tools

    async def respond(body: SamplingRequest, prompt: Prompt, request: Request, chat: bool) -> Response:
        prompt_ids = prompt.token_ids
        model.check_token_ids(body.stop_token_ids or [], "stop_token_ids")
        guided, tools = await off_loop(output_rules, body)  # the grammar library's first use imports it: seconds
        score_only = isinstance(body, CompletionRequest) and body.score_only
        # Scoring a prompt (max_tokens 0) still samples one token, which run_choice drops.
        max_tokens = max(1, model.resolve_max_tokens(body, len(prompt_ids)))
        sampling = body.sampling_params(max_tokens, model.eos_token_ids, model.vocab_size, guided)
        if model.tokenizer is None:
            if body.stop_strings:
                raise RequestError("stop strings need a tokenizer, and this server runs without one "
                                   "(--skip-tokenizer-init): use stop_token_ids", param="stop")
            # Without text, the token ids are the answer.
            body = body.model_copy(update={"return_token_ids": True})
        # Tool-call markers may be special tokens ([TOOL_CALLS], <|python_tag|>): the parser reads them in the text.
        keep = () if tools is None or tools.mode != "auto" else sampling.stop_token_ids
        choices = [Choice(i, make_detokenizer(model.tokenizer, body.stop_strings, keep_special_except=keep),
                          tools and tools.fresh()) for i in range(body.n)]
        seeds = [sampling.seed + i if sampling.seed is not None and body.n > 1 else sampling.seed for i in range(body.n)]
        session = request.headers.get(SESSION_HEADER) or None
        hint = request.headers.get(ROUTE_HEADER)
        if hint is not None and hint not in ("prefill", "decode"):
            raise RequestError(f"header {ROUTE_HEADER}: {hint!r} is not a route; use prefill or decode (or leave it "
                               "out and let the server's policy choose)", param=ROUTE_HEADER)
        unit = requested_unit(request)
        events = merge([run_choice(c, prompt_ids, msgspec.structs.replace(sampling, seed=s), session, hint, score_only,
                                   unit) for c, s in zip(choices, seeds)])
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.stream:
            # The first event comes before the headers go out, so that errors get a status and the route is known;
            # a client that leaves while it waits aborts the request there and then (not at its first token).
            waiting = asyncio.ensure_future(anext(events, None))
            gone = asyncio.ensure_future(wait_disconnect(request))
            await asyncio.wait((waiting, gone), return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if not waiting.done():
                waiting.cancel()  # raises in the choices' streams, whose exit aborts their requests
                with suppress(asyncio.CancelledError):
                    await waiting
                await events.aclose()
                return Response(status_code=499)
            first = waiting.result()
            headers = {ROUTE_HEADER: choices[0].route or "prefill", API_SERVER_HEADER: str(client.api_server)}
            sse = stream_events(response_id, body, chat, choices, prompt, events, first, model.token_text)
            return StreamingResponse(sse, media_type="text/event-stream", headers=headers)
        async with aclosing(events):
            collect = asyncio.ensure_future(drain(events))
            gone = asyncio.ensure_future(wait_disconnect(request))
            await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if not collect.done():
                # The client left: cancelling the drain closes the choices' streams, which aborts their requests.
                collect.cancel()
                with suppress(asyncio.CancelledError):
                    await collect
                return Response(status_code=499)
            collect.result()
        result = {"id": response_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                  "model": model.name, "choices": [choice_body(c, chat, body, model.token_text, prompt) for c in choices],
                  "usage": usage(prompt_ids, choices)}
        if chat and body.prompt_logprobs is not None:
            result["prompt_logprobs"] = prompt_logprobs_body(body, prompt, choices[0], model.token_text)
        if body.return_token_ids:
            result["prompt_token_ids"] = prompt_ids
        return Response(_json.encode(result), media_type="application/json",
                        headers={ROUTE_HEADER: choices[0].route or "prefill", API_SERVER_HEADER: str(client.api_server)})

    def requested_unit(request: Request) -> int | None:
        """The unit an outside router chose (vLLM's X-data-parallel-rank: vllm-router's kv_aware sends it to a
        node whose units it reads events from), checked."""
        raw = request.headers.get(RANK_HEADER)
        if raw is None:
            return None
        units = len(client.units)
        if not raw.strip().isdigit() or int(raw) >= units:
            raise RequestError(f"header {RANK_HEADER}: {raw!r} is not a unit of this server; it has {units} "
                               f"(0..{units - 1}), one per data-parallel rank", param=RANK_HEADER)
        return int(raw)

    async def run_choice(choice: Choice, prompt_ids: list[int], sampling: SamplingParams, session: str | None,
                         hint: str | None, score_only: bool, unit: int | None) -> AsyncIterator[Event]:
        """A choice's events; score_only: the prompt alone is the answer, the sampled token is dropped."""
        async with aclosing(client.generate(prompt_ids, sampling, session, hint, unit)) as deltas:
            async for delta in deltas:
                if delta.route is not None:
                    choice.route, choice.num_cached = delta.route, delta.num_cached_tokens or 0
                if delta.prompt_logprobs is not None:
                    choice.prompt_logprobs = delta.prompt_logprobs
                if score_only:
                    choice.finish_reason = "length"
                    yield Event(choice, "", [], None, choice.finish_reason)
                    return
                choice.token_ids += delta.token_ids
                choice.logprobs += delta.logprobs or []
                text = choice.detok.add(delta.token_ids)
                if choice.detok.stopped:
                    choice.finish_reason = "stop"
                elif delta.finish_reason:
                    text += choice.detok.flush()
                    choice.finish_reason = delta.finish_reason
                yield Event(choice, text, delta.token_ids, delta.logprobs, choice.finish_reason)
                if choice.finish_reason:
                    return  # leaving the loop closes `deltas`, which aborts the request after a stop string

    return app


async def merge(streams: list[AsyncIterator[Event]]) -> AsyncIterator[Event]:
    """Interleave the choices' events as they come; closing this closes them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for event in only:
                yield event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[Event]) -> None:
        try:
            async with aclosing(stream):
                async for event in stream:
                    await queue.put(event)
        except BaseException as exc:  # delivered to the consumer, re-raised there
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def drain(events: AsyncIterator[Event]) -> None:
    async for _ in events:
        pass


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
