"""`ppd bench --url` without a local tokenizer folder: prompt tokens counted by the server's
/tokenize (ppd serve's own token routes, in-process on a thread), exact lengths as with the
tokenizer at hand."""

from __future__ import annotations

import argparse
import random
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI
from transformers import AutoTokenizer

from bench.cli import _tokenizer
from bench.common import BenchError
from bench.server_tokenizer import ServerTokenizer
from bench.servers import free_port
from bench.workloads import shaped
from engine.demo import demo_model_path
from server.request_path import RequestPath, ServedModel
from server.tokenize_api import add_token_routes

SERVED = {
    "id": "remote-model",
    "root": "remote-model",
}  # a name, no folder here: the tokenizer is the server's


@pytest.fixture(scope="module")
def local_tokenizer(cache_dir: Path):
    return AutoTokenizer.from_pretrained(demo_model_path(cache_dir))


@pytest.fixture(scope="module")
def server(local_tokenizer) -> str:
    """ppd serve's /tokenize and /detokenize for the demo's tokenizer, served as remote-model."""
    model = ServedModel(
        "remote-model", "/not/here", local_tokenizer, 512, len(local_tokenizer), (0,)
    )
    app = FastAPI()
    add_token_routes(app, RequestPath(model, client=None))
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(10)


def _args(**given) -> argparse.Namespace:
    return argparse.Namespace(
        **{
            "tokenizer": None,
            "serve_args": "",
            "workload": "synthetic",
            "api": "chat",
            "api_key": None,
            **given,
        }
    )


def test_chat_prompts_get_exact_lengths_through_the_servers_tokenize(
    server: str, local_tokenizer, capsys: pytest.CaptureFixture
) -> None:
    tokenizer = _tokenizer(_args(), SERVED, server, server)
    assert isinstance(tokenizer, ServerTokenizer) and "/tokenize" in capsys.readouterr().err
    lengths = [(37, 4), (120, 4), (5, 4)]
    (conversation,) = shaped([lengths], 1, random.Random(0), tokenizer, "chat")
    counted = [
        len(local_tokenizer.encode(turn.user, add_special_tokens=False))
        for turn in conversation.turns
    ]
    assert counted == [n for n, _ in lengths]
    assert tokenizer.model_max_length == 512  # the server's context, as /tokenize reports it
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert ids == local_tokenizer.encode("hello world", add_special_tokens=False)
    assert tokenizer.decode(ids) == "hello world"


def test_each_text_is_asked_once(server: str) -> None:
    tokenizer = _tokenizer(_args(), SERVED, server, server)
    tokenizer.encode("the same text", add_special_tokens=False)
    before = tokenizer._encode.cache_info()
    tokenizer.encode("the same text", add_special_tokens=False)
    after = tokenizer._encode.cache_info()
    assert (after.hits, after.misses) == (before.hits + 1, before.misses)


def test_a_server_that_cannot_tokenize_stops_chat_and_not_token_ids() -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(BenchError, match="pass --api completions .* or --tokenizer PATH"):
        _tokenizer(_args(), SERVED, nobody, nobody)
    assert _tokenizer(_args(api="completions"), SERVED, nobody, nobody) is None


def test_a_local_tokenizer_folder_still_wins(server: str, cache_dir: Path) -> None:
    tokenizer = _tokenizer(_args(tokenizer=str(demo_model_path(cache_dir))), SERVED, server, server)
    assert not isinstance(tokenizer, ServerTokenizer) and tokenizer is not None
