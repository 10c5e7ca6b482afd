"""Response bodies and SSE chunks of the OpenAI-compatible API: choices, logprobs, tool calls, usage.

A choice accumulates its tokens, text and logprobs as the engine streams them; the shapes follow OpenAI's (chat:
message or delta, with logprobs.content; completions: text, with the legacy logprobs object) and vLLM's extensions
(token_ids, prompt_token_ids).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import msgspec

from engine.sampling_params import TokenLogprobs
from server.detokenizer import Detokenizer
from server.engine_client import EngineError
from server.protocol import RequestError, SamplingRequest, error_body, error_type
from server.tool_output import ToolOutput

log = logging.getLogger("ppd.api")
_json = msgspec.json.Encoder()


@dataclass
class Choice:
    """One of a request's n answers, as it accumulates."""

    index: int
    detok: Detokenizer
    tools: ToolOutput | None = None  # how tool calls come out of the text (None: the text is the content)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    route: str | None = None
    num_cached: int = 0


@dataclass
class Event:
    """New text, ids and logprobs of one choice; finish_reason set on its last event."""

    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None


class TokenText:
    """A token id's text and bytes as logprobs report them (cached: the same ids come back all the time).

    Byte-level tokenizers (GPT-2 style) map each byte to a printable character; their bytes are read back exactly,
    so a token holding half a UTF-8 character reports its real bytes (its text then shows U+FFFD, as OpenAI's does).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            return f"token_id:{token_id}", []
        raw = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(raw, str) and raw and all(c in _BYTE_OF for c in raw) and not _is_special(self.tokenizer, token_id):
            data = bytes(_BYTE_OF[c] for c in raw)
        else:
            data = self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        return data.decode("utf-8", errors="replace"), list(data)


def _is_special(tokenizer: Any, token_id: int) -> bool:
    return token_id in getattr(tokenizer, "all_special_ids", ())


def _byte_of() -> dict[str, int]:
    """GPT-2's printable character -> byte map (the inverse of its byte -> character alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF = _byte_of()


def chat_logprobs(tokens: list[int], logprobs: list[TokenLogprobs], text: TokenText) -> dict[str, Any]:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    content = []
    for token_id, lp in zip(tokens, logprobs):
        token, data = text.text(token_id)
        top = [{"token": (t := text.text(i))[0], "logprob": v, "bytes": t[1]} for i, v in zip(lp.top_ids, lp.top_logprobs)]
        content.append({"token": token, "logprob": lp.logprob, "bytes": data, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(tokens: list[int], logprobs: list[TokenLogprobs], text: TokenText,
                        offset: int) -> dict[str, Any]:
    """The completions API's logprobs: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset
    (each token's position in the text, counting from offset)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, lp in zip(tokens, logprobs):
        token = text.text(token_id)[0]
        out["tokens"].append(token)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({text.text(i)[0]: v for i, v in zip(lp.top_ids, lp.top_logprobs)})
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def usage(prompt_ids: list[int], choices: list[Choice]) -> dict:
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion, "total_tokens": len(prompt_ids) + completion,
            "prompt_tokens_details": {"cached_tokens": choices[0].num_cached}}


def choice_body(c: Choice, chat: bool, body: SamplingRequest, text: TokenText) -> dict:
    """A finished choice of a non-streamed response."""
    out: dict[str, Any] = {"index": c.index, "logprobs": None, "finish_reason": c.finish_reason}
    asked = body.logprobs_asked is not None
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": c.detok.text}
        if c.tools is not None:
            content, calls = c.tools.result(c.detok.text)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
            out["finish_reason"] = c.tools.finish_reason(c.finish_reason)
        out["message"] = message
        if asked:
            out["logprobs"] = chat_logprobs(c.token_ids, c.logprobs, text)
    else:
        out["text"] = c.detok.text
        if asked:
            out["logprobs"] = completion_logprobs(c.token_ids, c.logprobs, text, 0)
    if body.return_token_ids:
        out["token_ids"] = c.token_ids
    return out


async def stream_events(response_id: str, body: SamplingRequest, chat: bool, choices: list[Choice],
                        prompt_ids: list[int], events: AsyncIterator[Event], first: Event | None,
                        text: TokenText) -> AsyncIterator[bytes]:
    """The SSE body: a chunk per event, then a usage-only chunk if asked, then [DONE]; an error ends it early."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    asked = body.logprobs_asked is not None
    offsets = [0] * len(choices)  # completions: each choice's text so far, for text_offset

    def chunk(choice_bodies: list[dict], **extra: Any) -> bytes:
        obj = {"id": response_id, "object": kind, "created": created, "model": body.model, "choices": choice_bodies, **extra}
        return b"data: " + _json.encode(obj) + b"\n\n"

    async with aclosing(events):
        try:
            if chat:
                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for c in choices])
            event = first
            while event is not None:
                c = event.choice
                delta: dict[str, Any] = {}
                finish = event.finish_reason
                if chat and c.tools is not None:
                    delta = c.tools.delta(event.text, final=finish is not None)
                    finish = c.tools.finish_reason(finish)
                elif chat and event.text:
                    delta = {"content": event.text}
                has_logprobs = asked and bool(event.token_ids)
                if not (delta or (not chat and event.text) or finish or body.return_token_ids or has_logprobs):
                    event = await anext(events, None)  # e.g. half a UTF-8 character, held back
                    continue
                part: dict[str, Any] = {"index": c.index, "logprobs": None, "finish_reason": finish}
                if chat:
                    part["delta"] = delta
                    if has_logprobs:
                        part["logprobs"] = chat_logprobs(event.token_ids, event.logprobs or [], text)
                else:
                    part["text"] = event.text
                    if has_logprobs:
                        part["logprobs"] = completion_logprobs(event.token_ids, event.logprobs or [], text,
                                                               offsets[c.index])
                    offsets[c.index] += len(event.text)
                if body.return_token_ids:
                    part["token_ids"] = event.token_ids
                yield chunk([part])
                event = await anext(events, None)
            if body.include_usage:
                yield chunk([], usage=usage(prompt_ids, choices))
        except (EngineError, RequestError) as exc:
            status = exc.status
            yield b"data: " + _json.encode(error_body(exc.message, error_type(status), None, status)) + b"\n\n"
        except Exception as exc:  # a bug of ours: the client still gets an error event and [DONE], the log the rest
            log.error("a stream failed", exc_info=exc)
            message = f"internal error ({type(exc).__name__}); the server logged it"
            yield b"data: " + _json.encode(error_body(message, error_type(500), None, 500)) + b"\n\n"
        yield b"data: [DONE]\n\n"
