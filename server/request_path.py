"""The request path every API family shares: from a request's prompt ids and sampling fields to its
choices' events.

Each API family (chat and completions, tokens, responses, messages) turns its own body into prompt
token ids and a SamplingRequest, runs them through a RequestPath, and shapes the events into its own
responses with an Answer (server/answer.py); none of them imports another, and this module imports
none of them. A RequestPath checks the request against the model, builds the engine's sampling
parameters and the output's constraint (structured outputs, forced tool calls), splits the request
into its n choices, streams each from the engine client through an incremental detokenizer, answers
whole or streamed, and aborts them all when the client disconnects, which frees their KV blocks in
the worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.guided import spec_problem
from engine.sampling_params import MAX_LOGPROBS, GuidedSpec, SamplingParams
from server.answer import Answer, sse
from server.cache_hints import CacheHints, openai_hints
from server.detokenizer import make_detokenizer
from server.engine_client import EngineClient
from server.errors import RequestError, error_body_for
from server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from server.reasoning import THINK_END, ReasoningSplitter, thinks
from server.request_types import Choice, Event, Prompt
from server.tool_output import ToolOutput, tool_output_for
from server.tools import renders_tools, with_tool_prompt

_json = msgspec.json.Encoder()

# on a response: where the prefill ran; on a request: where to run an append-prefill
ROUTE_HEADER = "x-ppd-route"
API_SERVER_HEADER = (
    "x-ppd-api-server"  # on a response: which API-server process served it (--api-server-count)
)
SESSION_HEADER = "x-session-id"  # keeps a conversation on one unit
# apply_chat_template's arguments the server sets from the request itself
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "tokenize",
        "continue_final_message",
        "chat_template",
        "return_dict",
    }
)
RANK_HEADER = (
    "x-data-parallel-rank"  # vLLM's: the unit (data-parallel rank) an outside router chose
)


@dataclass
class ServedModel:
    """What the API needs to know of the model it serves."""

    name: str
    path: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tool_parser: str = (
        "auto"  # --tool-call-parser: how tool_choice auto reads calls out of the model's text
    )
    created: int = field(default_factory=lambda: int(time.time()))
    aliases: tuple[str, ...] = ()  # every --served-model-name a request may use (name: the first)
    # what else names the model: its path, and --model as given, where --served-model-name is not
    paths: tuple[str, ...] | None = None  # None: the path (ServedModel made without a plan)
    sampling_defaults: dict = field(
        default_factory=dict
    )  # for requests that leave them unset (--generation-config)
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs
    response_role: str = "assistant"  # --response-role: chat completions' answers' role
    force_usage: bool = False  # --enable-force-include-usage: usage on every response
    # --default-chat-template-kwargs: the template's arguments where a request sets none
    template_kwargs: dict = field(default_factory=dict)
    reasoning_parser: str | None = None  # --reasoning-parser: thinking split off the answer

    def chat_template_kwargs(self, asked: dict | None) -> dict:
        """A request's chat_template_kwargs over the server's defaults, checked: the arguments the
        server sets itself (messages, tools, ...) cannot be given."""
        kwargs = {**self.template_kwargs, **(asked or {})}
        if reserved := sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS):
            raise RequestError(
                f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them "
                "from the request's own fields",
                param="chat_template_kwargs",
            )
        return kwargs

    def thinks(self, body: SamplingRequest) -> bool:
        """Whether body's output opens with thinking that --reasoning-parser splits off."""
        if not isinstance(body, ChatCompletionRequest):
            return False
        return thinks(self.reasoning_parser, self.chat_template_kwargs(body.chat_template_kwargs))

    @property
    def names(self) -> tuple[str, ...]:
        return self.aliases or (self.name,)

    def check_model(self, name: str | None) -> None:
        """404 naming what is served unless name is one of the served names, or None (the one
        model), or one of `paths` (the model's path and --model as given, where no
        --served-model-name was: vLLM's rules)."""
        paths = (self.path,) if self.paths is None else self.paths
        if name is not None and name not in (*self.names, *paths):
            raise RequestError(
                f"The model `{name}` does not exist; this server serves "
                f"`{'`, `'.join(self.names)}`",
                status=404,
                param="model",
            )

    def with_defaults(self, body: SamplingRequest) -> SamplingRequest:
        """body with the server's sampling defaults (--generation-config) where it leaves a field
        unset (max_tokens: resolve_max_tokens)."""
        unset = {
            k: v
            for k, v in self.sampling_defaults.items()
            if k != "max_tokens" and getattr(body, k, 0) is None
        }
        return body.model_copy(update=unset) if unset else body

    def check_logprobs(self, body: SamplingRequest) -> None:
        asked = max(body.logprobs_asked or 0, body.prompt_logprobs_asked or 0)
        if asked > self.max_logprobs:
            raise RequestError(
                f"{asked} logprobs per token asked; this server returns at most "
                f"{self.max_logprobs} "
                "(--max-logprobs)",
                param="logprobs",
            )

    def need_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise RequestError(
                "this server runs without a tokenizer (--skip-tokenizer-init): send the prompt as "
                "a "
                "list of token ids to /v1/completions",
                param=param,
            )

    def need_chat_template(self) -> None:
        self.need_tokenizer("messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(
                f"the model {self.name} has no chat template (its tokenizer_config.json has none): "
                "use "
                "/v1/completions with a prompt, or serve a tokenizer that has one (--tokenizer)",
                param="messages",
            )

    def chat_prompt_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        """The token ids the chat template makes of messages (what /v1/chat/completions runs); tools
        a template does not write are described in the system message (server/tools.py
        with_tool_prompt); template_kwargs: the template's further arguments (enable_thinking)."""
        if tools and not renders_tools(getattr(self.tokenizer, "chat_template", None)):
            messages = with_tool_prompt(messages, tools)
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except Exception as exc:  # a template may raise on any input it dislikes (role order, ...)
            raise RequestError(
                f"the chat template rejected the messages: {exc}", param="messages"
            ) from exc
        return self.encode(text, "messages", add_special_tokens=add_special_tokens)

    def encode(self, text: str, param: str, **kw: Any) -> list[int]:
        try:
            return self.tokenizer.encode(text, **kw)
        except Exception as exc:  # e.g. a lone surrogate, which JSON allows and UTF-8 does not
            raise RequestError(
                f"the text cannot be tokenized ({type(exc).__name__}: {exc}); send valid Unicode",
                param=param,
            ) from exc

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        if token_ids and (bad := max(token_ids)) >= self.vocab_size:
            raise RequestError(
                f"token id {bad} is out of range: the model's vocabulary has {self.vocab_size} "
                f"tokens (ids 0..{self.vocab_size - 1})",
                param=param,
            )

    def resolve_max_tokens(self, body: SamplingRequest, num_prompt: int) -> int:
        room = self.max_model_len - num_prompt
        requested = body.requested_max_tokens
        if room < 1:  # the prompt alone: max_tokens is not to blame
            prompt = "messages" if hasattr(body, "messages") else "prompt"
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt is {num_prompt} tokens, leaving no room for the completion. Shorten "
                f"the {prompt} to fewer than {self.max_model_len} tokens.",
                param=prompt,
            )
        if requested is not None and requested > room:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt + requested} tokens ({num_prompt} in the prompt, "
                f"{requested} in the completion). Shorten the prompt or lower max_tokens to "
                f"{room} or fewer.",
                param="max_tokens",
            )
        if requested is None and (default := self.sampling_defaults.get("max_tokens")) is not None:
            return max(
                1, min(int(default), room)
            )  # the server's default fits what room is left, as vLLM's does
        return requested if requested is not None else room


def error_response(path: str, status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error answer to a request for path, in its API's shape (server.errors.error_body_for)."""
    return JSONResponse(error_body_for(path, message, status, param), status_code=status)


@dataclass
class Generation:
    """A request's choices while they run: their merged events (closing them aborts the requests),
    and the headers every response of it carries."""

    body: SamplingRequest
    prompt: Prompt
    choices: list[Choice]
    events: AsyncIterator[Event]
    api_server: int
    hints: CacheHints = CacheHints()
    retention: dict | None = None  # what its usage says of the retention asked (cache_hints)

    @property
    def headers(self) -> dict[str, str]:
        """Where the prefill ran and which API server answered (known once the first event came)."""
        return {
            ROUTE_HEADER: self.choices[0].route or "prefill",
            API_SERVER_HEADER: str(self.api_server),
        }


class RequestPath:
    """What every API family runs a request through (see the module's docstring)."""

    def __init__(self, model: ServedModel, client: EngineClient) -> None:
        self.model, self.client = model, client
        # Tokenizing and templating a long prompt takes milliseconds to seconds: off the event loop,
        # which streams every other client's tokens. One thread: a tokenizer object is not meant to
        # be used by two at once.
        self.text_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ppd-tokenize")

    async def off_loop(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, fn, *args)

    async def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The prompt ids /v1/chat/completions runs for body."""
        self.model.check_model(body.model)
        self.model.need_chat_template()
        kwargs = self.model.chat_template_kwargs(body.chat_template_kwargs)
        return await self.off_loop(
            partial(self.model.chat_prompt_ids, template_kwargs=kwargs),
            body.template_messages(),
            body.template_tools(),
        )

    async def completion_prompt(self, body: CompletionRequest) -> list[int]:
        """The prompt ids /v1/completions runs for body."""
        self.model.check_model(body.model)
        if isinstance(body.prompt, str):
            self.model.need_tokenizer("prompt")
            return await self.off_loop(self.model.encode, body.prompt, "prompt")
        self.model.check_token_ids(body.prompt, "prompt")
        return body.prompt

    def output_rules(
        self, body: SamplingRequest, thinking: bool = False
    ) -> tuple[GuidedSpec | None, ToolOutput | None]:
        """The constraint on the output (structured outputs, or a tool choice that forces calls),
        held after the thinking where the output opens with some, and how tool calls are read from
        the text, checked: a spec the grammar library cannot build is
        the client's error (400)."""
        model = self.model
        tools = (
            tool_output_for(body, model.tokenizer, model.tool_parser)
            if isinstance(body, ChatCompletionRequest)
            else None
        )
        asked = body.guided_spec()
        # OpenAI's response_format is the text's, and a forced call leaves no text (agents send
        # both): the call wins.
        if (
            tools is not None
            and tools.spec is not None
            and asked is not None
            and asked[1] != "response_format"
        ):
            raise RequestError(
                f"tool_choice {tools.mode} already constrains the output to tool calls; remove "
                f"{asked[1]}",
                param=asked[1],
            )
        spec, field = (
            (tools.spec, "tools")
            if tools is not None and tools.spec is not None
            else (asked or (None, None))
        )
        if spec is None:
            return None, tools
        if model.tokenizer is None:
            raise RequestError(
                "structured outputs need a tokenizer, and this server runs without one "
                "(--skip-tokenizer-init)",
                param=field,
            )
        if (problem := spec_problem(spec)) is not None:
            raise RequestError(f"{field}: {problem}", param=field)
        if thinking:  # the grammar holds for the answer, after the thinking
            end = model.tokenizer.encode(THINK_END, add_special_tokens=False)
            spec = msgspec.structs.replace(spec, after=tuple(end))
        return spec, tools

    async def start(
        self,
        body: SamplingRequest,
        prompt: Prompt,
        request: Request,
        hints: CacheHints | None = None,
    ) -> Generation:
        """Check the request and start its choices; their events come from the Generation's
        `events`. hints: the client's cache hints where its API has its own (Messages), else
        body's OpenAI fields."""
        hints = openai_hints(body) if hints is None else hints
        model, prompt_ids = self.model, prompt.token_ids
        body = model.with_defaults(body)
        model.check_logprobs(body)
        model.check_token_ids(body.stop_token_ids or [], "stop_token_ids")
        thinking = model.thinks(body)
        guided, tools = await self.off_loop(
            self.output_rules, body, thinking
        )  # the grammar library's first use imports it
        score_only = isinstance(body, CompletionRequest) and body.score_only
        # Scoring a prompt (max_tokens 0) still samples one token, which run_choice drops.
        max_tokens = max(1, model.resolve_max_tokens(body, len(prompt_ids)))
        sampling = body.sampling_params(max_tokens, model.eos_token_ids, model.vocab_size, guided)
        if model.tokenizer is None:
            if body.stop_strings:
                raise RequestError(
                    "stop strings need a tokenizer, and this server runs without one "
                    "(--skip-tokenizer-init): use stop_token_ids",
                    param="stop",
                )
            # Without text, the token ids are the answer.
            body = body.model_copy(update={"return_token_ids": True})
        # Tool-call markers may be special tokens ([TOOL_CALLS], <|python_tag|>): the parser reads
        # them in the text.
        keep = () if tools is None or tools.mode != "auto" else sampling.stop_token_ids
        choices = [
            Choice(
                i,
                make_detokenizer(model.tokenizer, body.stop_strings, keep_special_except=keep),
                tools and tools.fresh(),
                reasoning=None if model.reasoning_parser is None else ReasoningSplitter(thinking),
            )
            for i in range(body.n)
        ]
        seeds = [
            sampling.seed + i if sampling.seed is not None and body.n > 1 else sampling.seed
            for i in range(body.n)
        ]
        session = request.headers.get(SESSION_HEADER) or hints.key
        retention_on = self.client.retention_on
        retain_s = hints.applied_s(retention_on)
        hint = request.headers.get(ROUTE_HEADER)
        if hint is not None and hint not in ("prefill", "decode"):
            raise RequestError(
                f"header {ROUTE_HEADER}: {hint!r} is not a route; use prefill or decode (or leave "
                "it "
                "out and let the server's policy choose)",
                param=ROUTE_HEADER,
            )
        unit = self.requested_unit(request)
        events = merge(
            [
                self.run_choice(
                    c,
                    prompt_ids,
                    msgspec.structs.replace(sampling, seed=s),
                    session,
                    hint,
                    score_only,
                    unit,
                    retain_s,
                )
                for c, s in zip(choices, seeds)
            ]
        )
        return Generation(
            body,
            prompt,
            choices,
            events,
            self.client.api_server,
            hints,
            hints.report(retention_on),
        )

    async def respond(
        self,
        gen: Generation,
        request: Request,
        answer: Answer,
        headers: dict[str, str] | None = None,
    ) -> Response:
        """Answer a started generation as its body asks: streamed (SSE, from its first event on) or
        whole (JSON, once it finished), with gen's headers and these; 499 when the client left
        first, which aborts its requests."""
        if gen.body.stream:
            here, first = await self.first_event(gen, request)
            if not here:
                return Response(status_code=499)
            return StreamingResponse(
                sse(answer, gen.events, first),
                media_type="text/event-stream",
                headers={**gen.headers, **(headers or {})},
            )
        if not await self.finish(gen, request):
            return Response(status_code=499)
        return Response(
            _json.encode(await answer.whole()),
            media_type="application/json",
            headers={**gen.headers, **(headers or {})},
        )

    async def first_event(self, gen: Generation, request: Request) -> tuple[bool, Event | None]:
        """Wait for a streamed generation's first event: (False, None) when the client left first,
        which aborts the request there and then (not at its first token); else (True, the event,
        None for none). Waiting before the headers go out gives errors a status, and the route is
        known."""
        waiting = asyncio.ensure_future(anext(gen.events, None))
        gone = asyncio.ensure_future(wait_disconnect(request))
        await asyncio.wait((waiting, gone), return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not waiting.done():
            waiting.cancel()  # raises in the choices' streams, whose exit aborts their requests
            with suppress(asyncio.CancelledError):
                await waiting
            await gen.events.aclose()
            return False, None
        return True, waiting.result()

    async def finish(self, gen: Generation, request: Request) -> bool:
        """Run a generation to its end; False when the client left first (its requests are then
        aborted)."""
        async with aclosing(gen.events):
            collect = asyncio.ensure_future(drain(gen.events))
            gone = asyncio.ensure_future(wait_disconnect(request))
            await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if not collect.done():
                # The client left: cancelling the drain closes the choices' streams, which aborts
                # their requests.
                collect.cancel()
                with suppress(asyncio.CancelledError):
                    await collect
                return False
            collect.result()
        return True

    def requested_unit(self, request: Request) -> int | None:
        """The unit an outside router chose (vLLM's X-data-parallel-rank: vllm-router's kv_aware
        sends it to a node whose units it reads events from), checked."""
        raw = request.headers.get(RANK_HEADER)
        if raw is None:
            return None
        units = len(self.client.units)
        if not raw.strip().isdigit() or int(raw) >= units:
            raise RequestError(
                f"header {RANK_HEADER}: {raw!r} is not a unit of this server; it has {units} "
                f"(0..{units - 1}), one per data-parallel rank",
                param=RANK_HEADER,
            )
        return int(raw)

    async def run_choice(
        self,
        choice: Choice,
        prompt_ids: list[int],
        sampling: SamplingParams,
        session: str | None,
        hint: str | None,
        score_only: bool,
        unit: int | None,
        retain_s: float = 0.0,
    ) -> AsyncIterator[Event]:
        """A choice's events; score_only: the prompt alone is the answer, the sampled token is
        dropped."""
        async with aclosing(
            self.client.generate(prompt_ids, sampling, session, hint, unit, retain_s)
        ) as deltas:
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
                    # leaving the loop closes `deltas`, which aborts the request after a stop string
                    return


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
