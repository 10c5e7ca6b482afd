"""The load generator of `ppd bench`: multi-turn conversations against any OpenAI-compatible server.

Each turn resends the whole history with the server's own earlier answers (as vLLM's multi-turn
benchmark does), so a server with a prefix cache sees the growing prefix it produced; a turn that
carries a pause (a trace's tool or person) waits it after the previous answer. Conversations arrive
by a Poisson process (qps), keep a number in flight (concurrency), or start at their own start times
(replay, for traces). Only standard OpenAI fields are sent (with `cache_hints`, also its
prompt-cache hints), plus vLLM's `ignore_eos` / `return_token_ids` where needed; ppd's extras
(`x-ppd-route`, `usage.prompt_tokens_details.cached_tokens`) are read when present.

The client must not be what is measured: one aiohttp session whose pool holds `concurrency`
connections, one task per closed-loop slot (per conversation in an open loop, none per request),
the time taken as a read returns and before its lines are parsed, msgspec decoding only the fields
read. tests/bench/test_client.py checks its timings against `bench.stub_server`'s own and prints
its rate and timing overhead (TTFT beyond the server's own); the figures on a 2-core machine are in
docs/benchmarks.md#measurements-behind-the-code.
"""

from __future__ import annotations

import asyncio
import random
import sys
from dataclasses import dataclass, field
from itertools import count
from time import perf_counter
from typing import Any, Iterable, Iterator

import aiohttp
import msgspec
from tqdm import tqdm
from yarl import URL

NEEDS_TOKEN_IDS = "completions API multi-turn needs return_token_ids support"
APIS = ("chat", "completions", "responses")
_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
}


@dataclass
class Turn:
    user: str | list[int]  # new user input: text (chat API) or token ids (completions API)
    max_tokens: (
        int | None
    )  # output budget (None: sent without one); exact output length with ignore_eos
    # Seconds to wait after the previous answer ended before sending this turn (a tool running, a
    # person reading), times LoadConfig.time_scale; a first turn's is not waited.
    pause: float = 0.0


@dataclass
class Conversation:
    id: str
    turns: list[Turn]
    system: str | None = None
    ignore_eos: bool = False
    start: float = 0.0  # seconds from its trace's start: when a replay starts it (times time_scale)


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds (perf_counter)."""

    conversation: str
    turn: int  # 0-based turn index within the conversation
    start: float  # time.perf_counter() when the request was sent
    ttft: (
        float | None
    )  # seconds to the first streamed token (first chunk carrying text or token ids)
    itl: list[float]  # gaps between consecutive token-bearing chunks, seconds
    latency: (
        float | None
    )  # seconds from send to the end of the stream (to the failure, for a failed one)
    prompt_tokens: int  # from usage (0 if the server gave none)
    output_tokens: int  # from usage; if absent, the number of token-bearing chunks
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens when present
    route: str | None  # the x-ppd-route response header when present
    error: str | None = (
        None  # None on success; timeouts, HTTP errors, stream errors give a short reason
    )
    retries: int = 0  # times the server refused it (429 or 503 with Retry-After) before this answer
    # Tokens of this prompt that an earlier turn of its conversation already computed: the previous
    # request's prompt plus its answer, by the server's usage (None: a first turn, or no usage).
    history_tokens: int | None = None

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (latency - ttft) / (output_tokens - 1)."""
        if (
            self.error is not None
            or self.output_tokens < 2
            or self.ttft is None
            or self.latency is None
        ):
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class LoadConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (no /v1)
    model: str
    # "chat": /v1/chat/completions with messages; "completions": /v1/completions with token ids;
    # "responses": /v1/responses, each later turn only its new message after the previous response's
    # id (stored by the server)
    api: str = "chat"
    # Exactly one of qps, concurrency and replay gives the load.
    qps: float | None = None  # conversation arrival rate (Poisson)
    concurrency: int | None = (
        None  # closed loop: this many conversations in flight; a finished one is replaced
    )
    # Start each conversation once, at its `start` (counted from the earliest one's); the run ends
    # when all have finished, or at duration.
    replay: bool = False
    time_scale: float = 1.0  # times start times (replay) and pauses (every load): 0.1 is 10x faster
    duration: float = 60.0  # seconds: no new conversation starts and no new turn is sent after this
    timeout: float = (
        300.0  # seconds per request; a request past it counts as failed (error="timeout")
    )
    seed: int = 0  # Poisson arrival times are reproducible
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)  # merged into every request body
    headers: dict = field(
        default_factory=dict
    )  # sent with every request (e.g. x-ppd-route to force a route)
    # A request refused with a 429 or 503 that carries Retry-After is sent again after that long,
    # within its timeout, as OpenAI's SDK retries (the server saturated: the report says so); its
    # times count from its first sending.
    honor_retry_after: bool = True
    token_timing: bool = (
        False  # ask for return_token_ids on every request: TTFT and ITL time tokens, not text
    )
    # Send OpenAI's prompt-cache hints with every request: prompt_cache_key (the conversation's id)
    # and prompt_cache_retention (CACHE_RETENTION).
    cache_hints: bool = False


# Only the fields the client reads; msgspec skips the rest without building them.
class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = (
        None  # reasoning models' thinking (vLLM, SGLang): tokens, not history
    )
    reasoning: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None
    token_ids: list[int] | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_encode = msgspec.json.Encoder().encode
_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}
CACHE_RETENTION = "24h"


def poisson_arrivals(qps: float, seed: int) -> Iterator[float]:
    """Arrival offsets in seconds from the start: 0, then exponential gaps of mean 1/qps."""
    rng = random.Random(seed)
    t = 0.0
    while True:
        yield t
        t += rng.expovariate(qps)


def replay_arrivals(
    conversations: list[Conversation], time_scale: float
) -> Iterator[tuple[float, tuple[str, Conversation]]]:
    """Each conversation once, at its start time times time_scale, counted from the earliest's."""
    ordered = sorted(conversations, key=lambda conv: conv.start)
    for conv in ordered:
        yield (conv.start - ordered[0].start) * time_scale, (conv.id, conv)


def _error_message(err: Any) -> str:
    if isinstance(err, dict):
        err = err.get("error", err)
    if isinstance(err, dict):
        err = err.get("message", err)
    return str(err)[:300]


def _retry_after(value: str | None) -> float:
    """Seconds from a Retry-After header given in seconds (0 if absent or an HTTP date, which
    servers here never send)."""
    try:
        return max(0.0, float(value)) if value is not None else 0.0
    except ValueError:
        return 0.0


def _http_error(status: int, body: bytes) -> str:
    try:
        message = _error_message(msgspec.json.decode(body))
    except msgspec.DecodeError:
        message = body.decode(errors="replace").strip()[:300]
    return f"HTTP {status}: {message}"


def _check(cfg: LoadConfig, conversations: list[Conversation]) -> None:
    if (cfg.qps is not None) + (cfg.concurrency is not None) + cfg.replay != 1:
        raise ValueError(
            "set exactly one of qps (open loop), concurrency (closed loop) or replay (start times)"
        )
    if cfg.qps is not None and cfg.qps <= 0 or cfg.concurrency is not None and cfg.concurrency < 1:
        raise ValueError("qps must be > 0 and concurrency >= 1")
    if cfg.time_scale < 0:
        raise ValueError(f"time_scale must be >= 0, not {cfg.time_scale}")
    if cfg.api not in APIS:
        raise ValueError(f"api must be one of {', '.join(APIS)}, not {cfg.api!r}")
    if not conversations or any(not conv.turns for conv in conversations):
        raise ValueError("no conversations to send, or one without turns")
    want = list if cfg.api == "completions" else str
    for conv in conversations:
        if any(not isinstance(t.user, want) for t in conv.turns):
            raise ValueError(
                f"conversation {conv.id}: the {cfg.api} API needs turns of "
                f"{'text' if want is str else 'token ids'}; use the other --api or workload"
            )
        if cfg.api == "completions" and conv.system is not None:
            raise ValueError(f"conversation {conv.id}: a system prompt needs the chat API")


def _budget(key: str, turn: Turn) -> dict[str, int]:
    return {} if turn.max_tokens is None else {key: turn.max_tokens}


def _cycle(conversations: list[Conversation]) -> Iterator[tuple[str, Conversation]]:
    """The conversations in order, again and again; later rounds get ids like 'c12#2'."""
    for round_ in count(1):
        for conv in conversations:
            yield (conv.id if round_ == 1 else f"{conv.id}#{round_}"), conv


class _Load:
    """One run: the session, the deadline, the records and the progress bar."""

    def __init__(
        self,
        cfg: LoadConfig,
        session: aiohttp.ClientSession,
        records: list[RequestRecord],
        bar: tqdm,
    ) -> None:
        self.cfg, self.session, self.records, self.bar = cfg, session, records, bar
        self.t0 = perf_counter()
        self.deadline = self.t0 + cfg.duration
        base = cfg.base_url.rstrip("/").removesuffix("/v1")
        self.url = URL(base + _PATHS[cfg.api])
        self.headers = {**_HEADERS, **cfg.headers}
        self.failed = 0

    def add(self, record: RequestRecord) -> None:
        self.records.append(record)
        self.bar.update(1)
        if record.error is not None:
            self.failed += 1
            self.bar.set_postfix_str(f"failed={self.failed}", refresh=False)

    async def closed_loop(self, source: Iterator[tuple[str, Conversation]]) -> None:
        """One of `concurrency` slots: run conversations back to back until the deadline."""
        while perf_counter() < self.deadline:
            backoff = await self.conversation(*next(source))
            if backoff and self.cfg.honor_retry_after:
                await asyncio.sleep(min(backoff, max(0.0, self.deadline - perf_counter())))

    async def open_loop(self, arrivals: Iterable[tuple[float, tuple[str, Conversation]]]) -> None:
        """Start each conversation at its arrival (seconds from the run's start) until the deadline,
        then wait for them."""
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task] = set()
        try:
            for offset, (cid, conv) in arrivals:
                if offset >= self.cfg.duration:
                    break
                delay = self.t0 + offset - perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = loop.create_task(self.conversation(cid, conv))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        finally:
            await _cancel(tasks)

    async def pause(self, turn: Turn) -> bool:
        """Wait the turn's pause (times time_scale); False when the deadline comes first, since no
        turn is sent after it."""
        wait = turn.pause * self.cfg.time_scale
        if wait > 0:
            await asyncio.sleep(min(wait, max(0.0, self.deadline - perf_counter())))
        return perf_counter() < self.deadline

    def hints(self, conv: Conversation) -> dict[str, str]:
        """The prompt-cache hints of the conversation's requests (none unless cache_hints)."""
        if not self.cfg.cache_hints:
            return {}
        return {"prompt_cache_key": conv.id, "prompt_cache_retention": CACHE_RETENTION}

    async def conversation(self, cid: str, conv: Conversation) -> float:
        """Send the turns in order, each with the whole history and after its pause; stop at the
        first failure or the deadline. Returns the Retry-After seconds of a refusal that ended it (0
        otherwise)."""
        cfg, chat = self.cfg, self.cfg.api == "chat"
        if cfg.api == "responses":
            return await self.responses_conversation(cid, conv)
        base = {
            "model": cfg.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": cfg.temperature,
            **self.hints(conv),
        }
        if conv.ignore_eos:
            base["ignore_eos"] = True
        if cfg.token_timing or (not chat and len(conv.turns) > 1):
            base["return_token_ids"] = True
        history: list[dict] = (
            [{"role": "system", "content": conv.system}] if conv.system is not None else []
        )
        prompt_ids: list[int] = []
        computed = None  # tokens of the conversation the server has computed so far
        for i, turn in enumerate(conv.turns):
            if i and not await self.pause(turn):
                return 0.0
            if chat:
                history.append({"role": "user", "content": turn.user})
                body = {
                    **base,
                    "messages": history,
                    **_budget("max_tokens", turn),
                    **cfg.extra_body,
                }
            else:
                prompt_ids += turn.user
                body = {
                    **base,
                    "prompt": prompt_ids,
                    **_budget("max_tokens", turn),
                    **cfg.extra_body,
                }
            record, text, ids, retry_after, _ = await self.request(_encode(body), cid, i)
            record.history_tokens, computed = computed, _computed(record)
            self.add(record)
            if record.error is not None:
                return retry_after  # later turns would carry a wrong history
            if chat:
                history.append({"role": "assistant", "content": text})
            elif ids is not None:
                prompt_ids += ids
            elif i + 1 < len(conv.turns):
                self.add(
                    RequestRecord(
                        cid,
                        i + 1,
                        start=perf_counter(),
                        ttft=None,
                        itl=[],
                        latency=None,
                        prompt_tokens=0,
                        output_tokens=0,
                        cached_tokens=None,
                        route=None,
                        error=NEEDS_TOKEN_IDS,
                    )
                )
                return 0.0
        return 0.0

    async def responses_conversation(self, cid: str, conv: Conversation) -> float:
        """The turns through the Responses API: each sends only its new message, after the previous
        response's id (the server stored the conversation)."""
        cfg = self.cfg
        base = {
            "model": cfg.model,
            "stream": True,
            "temperature": cfg.temperature,
            "store": True,
            **self.hints(conv),
        }
        if conv.system is not None:
            base["instructions"] = conv.system
        if conv.ignore_eos:
            base["ignore_eos"] = True
        previous = computed = None
        for i, turn in enumerate(conv.turns):
            if i and not await self.pause(turn):
                return 0.0
            body = {
                **base,
                "input": turn.user,
                **_budget("max_output_tokens", turn),
                **cfg.extra_body,
            }
            if previous is not None:
                body["previous_response_id"] = previous
            record, _, _, retry_after, previous = await self.request(_encode(body), cid, i)
            record.history_tokens, computed = computed, _computed(record)
            self.add(record)
            if record.error is not None:
                return retry_after
        return 0.0

    async def request(
        self, body: bytes, cid: str, turn: int
    ) -> tuple[RequestRecord, str, list[int] | None, float, str | None]:
        """Send one streamed request, again after the Retry-After of each refusal while its timeout
        allows (unless told not to: a request sent before the run's end may be refused past it, and
        is still answered); the record, the streamed text, token ids (None if none came), the
        Retry-After seconds of a 429 or 503 that carried one and ended it (0 otherwise) and the
        response's id (Responses API)."""
        start, retries = perf_counter(), 0
        while True:
            record, text, ids, retry_after, response_id = await self._send(body, cid, turn, start)
            if (
                record.error is None
                or not retry_after
                or not self.cfg.honor_retry_after
                or perf_counter() + retry_after - start > self.cfg.timeout
            ):
                record.retries = retries
                return record, text, ids, retry_after, response_id
            retries += 1
            await asyncio.sleep(retry_after)

    async def _send(
        self, body: bytes, cid: str, turn: int, start: float
    ) -> tuple[RequestRecord, str, list[int] | None, float, str | None]:
        """One sending of a request first sent at `start` (request's results)."""
        route, retry_after = None, 0.0
        stream = _ResponsesStream(start) if self.cfg.api == "responses" else _Stream(start)
        try:
            async with self.session.post(self.url, data=body, headers=self.headers) as resp:
                route = resp.headers.get("x-ppd-route")
                if resp.status >= 400:
                    stream.error = _http_error(resp.status, await resp.read())
                    retry_after = (
                        _retry_after(resp.headers.get("retry-after"))
                        if resp.status in (429, 503)
                        else 0.0
                    )
                else:
                    read = resp.content.readany
                    while data := await read():
                        if stream.feed(
                            data, perf_counter()
                        ):  # the time is taken before any parsing
                            break
                    if stream.done:
                        while await read():
                            pass  # to the end, so that the connection goes back to the pool
                    elif stream.error is None:
                        stream.error = "stream ended before [DONE]"
        except asyncio.TimeoutError:  # aiohttp's total timeout, which covers reading the stream
            stream.error = "timeout"
        except aiohttp.ClientError as exc:
            stream.error = f"{type(exc).__name__}: {exc}"[:300]
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            stream.error = f"bad stream chunk: {exc}"[:300]
        return (
            stream.record(cid, turn, route),
            "".join(stream.texts),
            stream.ids,
            retry_after,
            stream.response_id,
        )


def _computed(record: RequestRecord) -> int | None:
    """Tokens the server has computed for the conversation once this request is answered: its
    prompt and its answer (None where usage gave no prompt tokens)."""
    return record.prompt_tokens + record.output_tokens if record.prompt_tokens else None


class _Stream:
    """What one SSE response has carried so far, with the arrival time of each token-bearing
    chunk."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.texts: list[str] = []
        self.ids: list[int] | None = None
        self.itl: list[float] = []
        self.ttft: float | None = None
        self.last = self.end = 0.0
        self.chunks = 0
        self.usage: _Usage | None = None
        self.error: str | None = None
        self.done = False
        self.pending = b""  # a line split across reads
        self.response_id: str | None = None  # the Responses API's

    def lines(self, data: bytes) -> list[bytes]:
        """The whole lines that data completes; a line it leaves unfinished waits for the next
        read."""
        lines = (self.pending + data).split(b"\n") if self.pending else data.split(b"\n")
        self.pending = lines.pop()
        return lines

    def feed(self, data: bytes, now: float) -> bool:
        """Take the bytes of one read, which arrived by `now`; True once [DONE] or an error event
        came."""
        for line in self.lines(data):
            if not line.startswith(b"data:"):
                continue  # blank separators, SSE comments and keep-alives
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done, self.end = True, now
                return True
            chunk = _decode_chunk(payload)
            if chunk.error is not None:
                self.error = _error_message(chunk.error)
                return True
            bearing = False
            for choice in chunk.choices or ():
                delta = choice.delta
                piece = delta.content if delta is not None else choice.text
                if piece:
                    self.texts.append(piece)
                    bearing = True
                elif delta is not None and (delta.reasoning_content or delta.reasoning):
                    bearing = True
                if choice.token_ids is not None:
                    if self.ids is None:
                        self.ids = []
                    if choice.token_ids:
                        self.ids += choice.token_ids
                        bearing = True
            if bearing:
                if self.ttft is None:
                    self.ttft = now - self.start
                else:
                    self.itl.append(now - self.last)
                self.last = now
                self.chunks += 1
            if chunk.usage is not None:
                self.usage = chunk.usage
        return False

    def record(self, cid: str, turn: int, route: str | None) -> RequestRecord:
        end = perf_counter() if self.error is not None else self.end
        usage = self.usage or _Usage()
        details = usage.prompt_tokens_details
        return RequestRecord(
            conversation=cid,
            turn=turn,
            start=self.start,
            ttft=self.ttft,
            itl=self.itl,
            latency=end - self.start,
            prompt_tokens=usage.prompt_tokens or 0,
            output_tokens=usage.completion_tokens
            if usage.completion_tokens is not None
            else self.chunks,
            cached_tokens=details.cached_tokens if details is not None else None,
            route=route,
            error=self.error,
        )


class _RespUsage(msgspec.Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None
    input_tokens_details: _Details | None = None


class _Resp(msgspec.Struct):
    id: str | None = None
    usage: _RespUsage | None = None


class _RespEvent(msgspec.Struct):
    type: str = ""
    delta: str | None = None
    response: _Resp | None = None
    message: str | None = None


_decode_event = msgspec.json.Decoder(_RespEvent).decode
_RESPONSE_ENDS = (b"response.completed", b"response.incomplete", b"response.failed")


class _ResponsesStream(_Stream):
    """A Responses API stream: typed events, no [DONE]. The first token's time is
    response.created's: ppd sends it with the first token (so that an error before it still gets
    an HTTP status), where OpenAI sends it at once; elsewhere it would time the request's
    acceptance, not a token. Output text deltas time the later tokens."""

    def feed(self, data: bytes, now: float) -> bool:
        for line in self.lines(data):
            if not line.startswith(b"data:"):
                continue
            event = _decode_event(line[5:].strip())
            kind = event.type
            if kind == "response.created":
                self.ttft, self.last = now - self.start, now
                self.response_id = event.response.id if event.response else None
            elif kind == "response.output_text.delta" and event.delta:
                self.texts.append(event.delta)
                self.itl.append(now - self.last)
                self.last = now
                self.chunks += 1
            elif kind.encode() in _RESPONSE_ENDS:
                usage = event.response.usage if event.response is not None else None
                if usage is not None:
                    self.usage = _Usage(
                        usage.input_tokens, usage.output_tokens, usage.input_tokens_details
                    )
                if kind == "response.failed":
                    self.error = "response.failed"
                self.done, self.end = True, now
                return True
            elif kind == "error":
                self.error = (event.message or "error event")[:300]
                return True
        return False


async def _cancel(tasks: set[asyncio.Task] | list[asyncio.Task]) -> None:
    """Cancel the tasks and wait until they have unwound (closing their connections)."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def run_load(
    cfg: LoadConfig,
    conversations: list[Conversation],
    progress: bool = True,
    records: list[RequestRecord] | None = None,
) -> list[RequestRecord]:
    """Drive the conversations against the server and return one record per request sent.

    Records are appended to `records` (when given) as each request completes, so a caller that
    cancels the run (Ctrl-C) keeps what was measured; in-flight requests are then abandoned.
    """
    _check(cfg, conversations)
    records = [] if records is None else records
    source = _cycle(conversations)
    # Closed loop: a pool of exactly `concurrency` connections. Open loop: unbounded, since waiting
    # for a connection inside the client would hide the server's queueing from the measured TTFT.
    connector = aiohttp.TCPConnector(limit=cfg.concurrency or 0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout)
    bar = tqdm(
        desc="requests", unit=" req", file=sys.stderr, disable=not progress, postfix="failed=0"
    )
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar(), trust_env=False
    ) as session:
        load = _Load(cfg, session, records, bar)
        tasks: list[asyncio.Task] = []
        try:
            if cfg.concurrency is not None:
                tasks = [
                    asyncio.create_task(load.closed_loop(source)) for _ in range(cfg.concurrency)
                ]
                await asyncio.gather(*tasks)
            elif cfg.replay:
                await load.open_loop(replay_arrivals(conversations, cfg.time_scale))
            else:
                await load.open_loop(zip(poisson_arrivals(cfg.qps, cfg.seed), source))
        finally:
            await _cancel(tasks)
            bar.close()
    return records
