"""Serving without the model folder's tokenizer: another folder's (--tokenizer), or none
(--skip-tokenizer-init), as a configuration with dummy weights needs."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine.demo import demo_model_path
from tests.server_process import ServerProcess
from tests.tiny_models import write_tiny_model


# a server of its own, about 18 s on 2 cores: in the second suite, under the default one's budget
@pytest.mark.slow
def test_skip_tokenizer_init_serves_token_ids(start_server, weights_only: Path) -> None:
    server: ServerProcess = start_server(
        "--model", str(weights_only), "--skip-tokenizer-init", "--served-model-name", "m"
    )
    resp = httpx.post(
        f"{server.url}/v1/completions",
        timeout=60,
        json={
            "model": "m",
            "prompt": [72, 101, 108, 108, 111],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert len(choice["token_ids"]) == 5 and choice["text"] == ""  # ids are the answer
    for path, body, param in (
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ("completions", {"prompt": "hi"}, "prompt"),
    ):
        resp = httpx.post(
            f"{server.url}/v1/{path}", timeout=30, json={"model": "m", "max_tokens": 2, **body}
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param
        assert "--skip-tokenizer-init" in resp.json()["error"]["message"]
    resp = httpx.post(
        f"{server.url}/v1/completions",
        timeout=30,
        json={"model": "m", "prompt": [72, 101], "max_tokens": 2, "stop": ["x"]},
    )
    assert resp.status_code == 400 and "stop_token_ids" in resp.json()["error"]["message"]


# a server of its own (about 30 s on 2 cores): in the second suite, under the default one's budget
@pytest.mark.slow
def test_tokenizer_from_another_folder(start_server, weights_only: Path, cache_dir: Path) -> None:
    server: ServerProcess = start_server(
        "--model",
        str(weights_only),
        "--tokenizer",
        str(demo_model_path(cache_dir)),
        "--served-model-name",
        "m",
    )
    resp = httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=60,
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "ignore_eos": True,
        },
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4


def test_a_folder_without_tokenizer_is_refused_before_any_worker_starts(weights_only: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "cli", "serve", "--model", str(weights_only), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert (
        "tokenizer" in result.stderr
        and "--skip-tokenizer-init" in result.stderr
        and "--tokenizer" in result.stderr
    )
    assert "Traceback" not in result.stderr and "ppd.launcher" not in result.stderr


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_folder_of_config_and_weights_alone_is_refused_in_one_line(
    arch: str, tmp_path: Path
) -> None:
    """transformers improvises a tokenizer for a Qwen3 folder without tokenizer files, and refuses a
    Llama one in three lines about sentencepiece and tiktoken: the server says in one line what is
    missing and the two ways on."""
    import subprocess
    import sys

    folder = write_tiny_model(tmp_path / arch, arch)
    result = subprocess.run(
        [sys.executable, "-m", "cli", "serve", "--model", str(folder), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1 and "has no tokenizer files (tokenizer.json, tokenizer.model" in lines[0]
    ), result.stderr
    assert "--tokenizer FOLDER" in lines[0] and "--skip-tokenizer-init" in lines[0]


def test_a_generic_fast_tokenizer_loads_as_autotokenizer_makes_it(cache_dir) -> None:
    """A folder whose tokenizer_config.json names transformers' generic fast tokenizer is loaded as
    that class directly (no AutoConfig, seconds of every start): the same class, ids, special tokens
    and chat template as AutoTokenizer's; a folder naming another class is left to AutoTokenizer."""
    from transformers import AutoTokenizer

    from engine.tokenizer import generic_tokenizer
    from server.serve import load_tokenizer

    folder = str(demo_model_path(cache_dir))
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    text = "Hello é 中 <|im_end|>"
    chat = [{"role": "user", "content": text}]
    assert type(ours) is type(theirs) and ours.encode(text) == theirs.encode(text)
    assert ours.all_special_tokens == theirs.all_special_tokens and len(ours) == len(theirs)
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(
        chat, tokenize=False
    )
    assert generic_tokenizer(str(Path(__file__).parent)) is None  # no tokenizer_config.json
