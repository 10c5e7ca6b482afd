"""The served model's tokenizer, asked over HTTP: POST /tokenize and /detokenize (vLLM's endpoints;
ppd serve has them too). A benchmark against a running server whose tokenizer folder is not on
this machine counts prompt tokens this way, with the very tokenizer that will run them, so its
prompt lengths are exact.
"""

from __future__ import annotations

import functools
from typing import Any

import httpx

from bench.common import BenchError

CACHE_SIZE = (
    4096  # texts and id lists remembered: fitting a text to a length re-encodes its prefixes
)


class ServerTokenizer:
    """What the workloads ask of a tokenizer (bench/workloads.py: encode without special tokens,
    decode), answered by the server behind `client` for `model`, each distinct question asked once.
    Shaped as a transformers tokenizer: encode(text, add_special_tokens=..., verbose=...),
    decode(ids), model_max_length (the server's context)."""

    def __init__(self, client: httpx.Client, model: str) -> None:
        self.client, self.model = client, model
        self.model_max_length: int | None = None
        self._encode = functools.lru_cache(CACHE_SIZE)(self._tokenize)
        self._decode = functools.lru_cache(CACHE_SIZE)(self._detokenize)

    def encode(
        self, text: str, add_special_tokens: bool = True, verbose: bool = False
    ) -> list[int]:
        return list(self._encode(text, add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self._decode(tuple(ids))

    def _tokenize(self, text: str, add_special_tokens: bool) -> tuple[int, ...]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
        answer = self._post("/tokenize", body)
        self.model_max_length = answer.get("max_model_len") or self.model_max_length
        return tuple(answer["tokens"])

    def _detokenize(self, ids: tuple[int, ...]) -> str:
        return self._post("/detokenize", {"model": self.model, "tokens": list(ids)})["prompt"]

    def _post(self, path: str, body: dict) -> dict[str, Any]:
        try:
            resp = self.client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise BenchError(f"{path} of {self.client.base_url} did not answer ({exc})") from exc
        if resp.status_code != 200:
            raise BenchError(
                f"{path} of {self.client.base_url} answered {resp.status_code}: {_message(resp)}"
            )
        try:
            return resp.json()
        except ValueError as exc:
            raise BenchError(
                f"{path} of {self.client.base_url} answered something other than JSON"
            ) from exc


def server_tokenizer(
    url: str, model: str, headers: dict[str, str] | None = None
) -> ServerTokenizer:
    """The tokenizer of `model` at the server at url, checked with one question; BenchError saying
    why where the server cannot tokenize (no /tokenize route, or a server without a tokenizer)."""
    tokenizer = ServerTokenizer(
        httpx.Client(base_url=url, headers=headers or {}, timeout=60), model
    )
    tokenizer.encode("hello", add_special_tokens=False)
    return tokenizer


def _message(resp: httpx.Response) -> str:
    """The error's message where the body is OpenAI's error shape, else the body's start."""
    try:
        error = resp.json().get("error")
        return str(error.get("message") if isinstance(error, dict) else error or resp.text[:200])
    except (ValueError, AttributeError):
        return resp.text[:200]
