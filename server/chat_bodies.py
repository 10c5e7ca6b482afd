"""Response bodies and SSE chunks of OpenAI's chat and text completions: choices, logprobs, tool
calls, usage.

The shapes follow OpenAI's (chat: message or delta, with logprobs.content; completions: text, with
the legacy logprobs object) and vLLM's extensions (token_ids, prompt_token_ids, prompt_logprobs).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from functools import lru_cache
from typing import Any

import msgspec

from engine.sampling_params import TokenLogprobs
from server.errors import error_body, error_type
from server.protocol import SamplingRequest
from server.reasoning import whole
from server.request_path import Generation
from server.request_types import Choice, Event, Prompt

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


class TokenText:
    """A token id's text and bytes as logprobs report them (cached: the same ids come back all the
    time).

    Byte-level tokenizers (GPT-2 style) map each byte to a printable character; their bytes are read
    back exactly, so a token holding half a UTF-8 character reports its real bytes (its text then
    shows U+FFFD, as OpenAI's does).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            return f"token_id:{token_id}", []
        raw = self.tokenizer.convert_ids_to_tokens(token_id)
        if (
            isinstance(raw, str)
            and raw
            and all(c in _BYTE_OF for c in raw)
            and not _is_special(self.tokenizer, token_id)
        ):
            data = bytes(_BYTE_OF[c] for c in raw)
        else:
            data = self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        return data.decode("utf-8", errors="replace"), list(data)


def _is_special(tokenizer: Any, token_id: int) -> bool:
    return token_id in getattr(tokenizer, "all_special_ids", ())


def _byte_of() -> dict[str, int]:
    """GPT-2's printable character -> byte map (the inverse of its byte -> character alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF = _byte_of()


def chat_logprobs(
    tokens: list[int], logprobs: list[TokenLogprobs], text: TokenText
) -> dict[str, Any]:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
    bytes}]}]}."""
    content = []
    for token_id, lp in zip(tokens, logprobs):
        token, data = text.text(token_id)
        top = [
            {"token": (t := text.text(i))[0], "logprob": v, "bytes": t[1]}
            for i, v in zip(lp.top_ids, lp.top_logprobs)
        ]
        content.append({"token": token, "logprob": lp.logprob, "bytes": data, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(
    tokens: list[int],
    logprobs: Sequence[TokenLogprobs | None],
    text: TokenText,
    offset: int,
    top: int | None = None,
) -> dict[str, Any]:
    """The completions API's logprobs: tokens, token_logprobs, top_logprobs (token -> logprob, at
    most top), text_offset (each token's position in the text, counting from offset). A None
    logprob (an echoed prompt's first token, which nothing predicts) shows as null in both lists."""
    out: dict[str, Any] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token_id, lp in zip(tokens, logprobs):
        token = text.text(token_id)[0]
        out["tokens"].append(token)
        out["token_logprobs"].append(None if lp is None else lp.logprob)
        out["top_logprobs"].append(
            None
            if lp is None
            else {text.text(i)[0]: v for i, v in zip(lp.top_ids[:top], lp.top_logprobs[:top])}
        )
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def echoed_logprobs(
    prompt: Prompt,
    c: Choice,
    tokens: list[int],
    logprobs: list[TokenLogprobs],
    text: TokenText,
    top: int,
) -> dict[str, Any]:
    """Completions logprobs over the echoed prompt (when c has not shown it yet: pass its first
    tokens) and then tokens; the prompt's count from 0, the tokens' from the end of the echoed
    text."""
    shown = completion_logprobs(prompt.token_ids, [None, *(c.prompt_logprobs or [])], text, 0, top)
    after = completion_logprobs(tokens, logprobs, text, len(prompt.echo or ""), top)
    return {key: shown[key] + after[key] for key in shown}


def vllm_prompt_logprobs(
    prompt_ids: list[int], logprobs: list[TokenLogprobs], top: int, text: TokenText
) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: {logprob, rank,
    decoded_token}} for the prompt's own token and then up to top alternatives."""
    out: list[dict[str, Any] | None] = [None]
    for token_id, lp in zip(prompt_ids[1:], logprobs):
        entry = {
            str(token_id): {
                "logprob": lp.logprob,
                "rank": lp.rank,
                "decoded_token": text.text(token_id)[0],
            }
        }
        for rank, (i, v) in enumerate(zip(lp.top_ids[:top], lp.top_logprobs[:top]), start=1):
            entry.setdefault(str(i), {"logprob": v, "rank": rank, "decoded_token": text.text(i)[0]})
        out.append(entry)
    return out


def usage(prompt_ids: list[int], choices: list[Choice], retention: dict | None = None) -> dict:
    """OpenAI's usage; cached_tokens counts the prompt's tokens served from the prefix cache or
    loaded from the second tier (not computed again). retention: what was applied of the
    client's prompt_cache_retention (server/cache_hints.py)."""
    completion = sum(len(c.token_ids) for c in choices)
    out = {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt_ids) + completion,
        "prompt_tokens_details": {"cached_tokens": choices[0].num_cached},
    }
    if retention is not None:
        out["ppd_cache_retention"] = retention
    return out


def prompt_logprobs_body(
    body: SamplingRequest, prompt: Prompt, c: Choice, text: TokenText
) -> list | None:
    """The prompt_logprobs a response shows (None: not asked)."""
    if body.prompt_logprobs is None:
        return None
    return vllm_prompt_logprobs(
        prompt.token_ids, c.prompt_logprobs or [], body.prompt_logprobs, text
    )


def reasoning_fields(thinking: str | None) -> dict[str, str | None]:
    """The thinking of a reasoning model's answer, under both names clients read it by:
    reasoning_content (DeepSeek's API, older vLLM's) and reasoning (vLLM 0.32's)."""
    return {"reasoning_content": thinking, "reasoning": thinking}


def choice_body(
    c: Choice,
    chat: bool,
    body: SamplingRequest,
    text: TokenText,
    prompt: Prompt,
    role: str = "assistant",
) -> dict:
    """A finished choice of a non-streamed response (chat's prompt_logprobs go on the response, not
    the choice)."""
    out: dict[str, Any] = {"index": c.index, "logprobs": None, "finish_reason": c.finish_reason}
    asked = body.logprobs_asked is not None
    if chat:
        answer = c.detok.text
        message: dict[str, Any] = {"role": role, "content": answer}
        if c.reasoning is not None:
            thinking, answer = whole(answer, c.reasoning.thinking)
            message.update(reasoning_fields(thinking), content=answer)
        if c.tools is not None:
            content, calls = c.tools.result(answer)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
            out["finish_reason"] = c.tools.finish_reason(c.finish_reason)
        out["message"] = message
        if asked:
            out["logprobs"] = chat_logprobs(c.token_ids, c.logprobs, text)
    else:
        out["text"] = (prompt.echo or "") + c.detok.text
        if asked and prompt.echo is not None:
            out["logprobs"] = echoed_logprobs(
                prompt, c, c.token_ids, c.logprobs, text, body.logprobs_asked
            )
        elif asked:
            out["logprobs"] = completion_logprobs(c.token_ids, c.logprobs, text, 0)
        if body.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs_body(body, prompt, c, text)
    if body.return_token_ids:
        out["token_ids"] = c.token_ids
    return out


class ChatAnswer:
    """A chat.completion or text_completion (server/answer.py's Answer). Streamed: a chunk per
    event, then a usage-only chunk if asked, then [DONE], which follows an error too; a choice's
    first chunk carries its echoed prompt and prompt logprobs (chat: the response's first chunk)."""

    def __init__(
        self,
        response_id: str,
        gen: Generation,
        chat: bool,
        model_name: str,
        text: TokenText,
        role: str = "assistant",
        force_usage: bool = False,
    ) -> None:
        self.id, self.body, self.chat, self.model_name, self.text = (
            response_id,
            gen.body,
            chat,
            model_name,
            text,
        )
        self.role = role  # --response-role
        self.force_usage = force_usage  # --enable-force-include-usage
        self.choices, self.prompt = gen.choices, gen.prompt
        self.retention = gen.retention
        self.created = 0  # a stream's: set as it opens
        self.offsets = [0] * len(
            self.choices
        )  # completions: each choice's text so far, for text_offset
        self.started: set[int] = set()  # choices that had a chunk

    async def whole(self) -> dict[str, Any]:
        body, prompt, choices, text = self.body, self.prompt, self.choices, self.text
        result = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice_body(c, self.chat, body, text, prompt, self.role) for c in choices],
            "usage": usage(prompt.token_ids, choices, self.retention),
        }
        if self.chat and body.prompt_logprobs is not None:
            result["prompt_logprobs"] = prompt_logprobs_body(body, prompt, choices[0], text)
        if body.return_token_ids:
            result["prompt_token_ids"] = prompt.token_ids
        return result

    def chunk(self, choice_bodies: list[dict], **extra: Any) -> bytes:
        obj = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": choice_bodies,
            **extra,
        }
        return b"data: " + _json.encode(obj) + b"\n\n"

    def opening(self) -> list[bytes]:
        self.created = int(time.time())
        if not self.chat:
            return []
        return [
            self.chunk(
                [
                    {
                        "index": c.index,
                        "delta": {"role": self.role, "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for c in self.choices
                ]
            )
        ]

    def chunks(self, event: Event) -> list[bytes]:
        body, prompt, chat, text = self.body, self.prompt, self.chat, self.text
        asked = body.logprobs_asked is not None
        c = event.choice
        first = c.index not in self.started
        self.started.add(c.index)
        delta: dict[str, Any] = {}
        finish = event.finish_reason
        answer, thinking = event.text, ""
        if chat and c.reasoning is not None:
            split = c.reasoning.feed(event.text, final=finish is not None)
            answer, thinking = split.content, split.reasoning
        if chat and c.tools is not None:
            delta = c.tools.delta(answer, final=finish is not None)
            finish = c.tools.finish_reason(finish)
        elif chat and answer:
            delta = {"content": answer}
        if thinking:
            delta = {**reasoning_fields(thinking), **delta}
        has_logprobs = asked and bool(event.token_ids)
        shows_prompt = first and (prompt.echo is not None or body.prompt_logprobs is not None)
        if not (
            delta
            or (not chat and event.text)
            or finish
            or body.return_token_ids
            or has_logprobs
            or shows_prompt
        ):
            return []
        part: dict[str, Any] = {"index": c.index, "logprobs": None, "finish_reason": finish}
        extra: dict[str, Any] = {}
        if chat:
            part["delta"] = delta
            if has_logprobs:
                part["logprobs"] = chat_logprobs(event.token_ids, event.logprobs or [], text)
            if shows_prompt and len(self.started) == 1:
                extra["prompt_logprobs"] = prompt_logprobs_body(body, prompt, c, text)
        else:
            echo = prompt.echo if first and prompt.echo is not None else ""
            part["text"] = echo + event.text
            if asked and first and prompt.echo is not None:
                part["logprobs"] = echoed_logprobs(
                    prompt, c, event.token_ids, event.logprobs or [], text, body.logprobs_asked
                )
            elif has_logprobs:
                part["logprobs"] = completion_logprobs(
                    event.token_ids, event.logprobs or [], text, self.offsets[c.index]
                )
            if first and body.prompt_logprobs is not None:
                part["prompt_logprobs"] = prompt_logprobs_body(body, prompt, c, text)
            self.offsets[c.index] += len(part["text"])
        if body.return_token_ids:
            part["token_ids"] = event.token_ids
        return [self.chunk([part], **extra)]

    async def closing(self) -> AsyncIterator[bytes]:
        if self.body.include_usage or self.force_usage:
            yield self.chunk([], usage=usage(self.prompt.token_ids, self.choices, self.retention))
        yield DONE

    def error(self, status: int, message: str) -> list[bytes]:
        return [
            b"data: "
            + _json.encode(error_body(message, error_type(status), None, status))
            + b"\n\n",
            DONE,
        ]
