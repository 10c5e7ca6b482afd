"""The built-in demo model: folder building, caching, and what transformers makes of it."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest
import torch
import transformers
from jinja2.exceptions import TemplateError
from transformers import AutoTokenizer

from engine import demo
from engine.demo import DEMO_MODEL, demo_model_path, write_byte_tokenizer

SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]
TEXTS = [
    "Hello, world!",
    "héllo wörld — ñ",
    "日本語のテキスト，中文",
    "emoji 🙂👍🏽 and a family 👨‍👩‍👧",
    "tabs\tand\nnewlines\r\n  spaces  ",
    "odd bytes \x00\x01\x7f and combining e\u0301",
    "clean-up bait: a . b , c ' d n't",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_model_path(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> transformers.PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def test_builds_the_expected_folder_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo is built from engine/demo.py alone, so `ppd serve` runs on a machine without network
    access."""

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"the demo build reached for the network: {args}")

    for name in ("connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    folder = demo_model_path(tmp_path)
    monkeypatch.undo()
    assert folder == tmp_path / "demo-v2"
    names = {p.name for p in folder.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "README.md",
    } <= names
    assert "random" in (folder / "README.md").read_text().lower()
    assert [p.name for p in tmp_path.iterdir()] == ["demo-v2"], "no temporary folder is left behind"
    assert DEMO_MODEL == "demo"


def test_config_describes_a_small_llama(
    model_dir: Path, tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (
        256,
        4,
        768,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 4)
    assert config["vocab_size"] == 320 and config["max_position_embeddings"] == 4096
    assert config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert config["bos_token_id"] == tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    end_ids = {tokenizer.convert_tokens_to_ids(t) for t in ("<|end|>", "<|end_of_text|>")}
    assert set(config["eos_token_id"]) == end_ids
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert set(generation["eos_token_id"]) == end_ids


def test_second_call_reuses_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = demo_model_path(tmp_path)

    def fail(_: Path) -> None:
        raise AssertionError("the demo model was rebuilt")

    monkeypatch.setattr(demo, "_write_demo_model", fail)
    assert demo_model_path(tmp_path) == folder


def test_cache_dir_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PPD_CACHE_DIR", str(tmp_path / "env-cache"))
    assert demo_model_path() == tmp_path / "env-cache" / "demo-v2"


def test_losing_the_build_race_uses_the_winners_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = demo._write_demo_model
    winner: list[Path] = []

    def write_while_another_process_finishes_first(folder: Path) -> None:
        real_write(folder)
        monkeypatch.setattr(demo, "_write_demo_model", real_write)
        winner.append(demo_model_path(tmp_path))  # the other process renames its build into place

    monkeypatch.setattr(demo, "_write_demo_model", write_while_another_process_finishes_first)
    folder = demo_model_path(tmp_path)
    assert winner == [folder]
    assert [p.name for p in tmp_path.iterdir()] == ["demo-v2"], "the loser's build is cleaned up"


def test_concurrent_builds_are_safe(tmp_path: Path) -> None:
    barrier = threading.Barrier(8)
    results: list[Path] = []
    errors: list[Exception] = []

    def build() -> None:
        barrier.wait()
        try:
            results.append(demo_model_path(tmp_path))
        except Exception as exc:  # reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert set(results) == {tmp_path / "demo-v2"}
    assert [p.name for p in tmp_path.iterdir()] == ["demo-v2"]
    AutoTokenizer.from_pretrained(tmp_path / "demo-v2", local_files_only=True)


def test_weights_are_deterministic(tmp_path: Path, model_dir: Path) -> None:
    other = demo_model_path(tmp_path)
    assert (other / "model.safetensors").read_bytes() == (
        model_dir / "model.safetensors"
    ).read_bytes()


def test_transformers_loads_every_weight(model_dir: Path) -> None:
    model, info = transformers.LlamaForCausalLM.from_pretrained(
        model_dir, output_loading_info=True, local_files_only=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.float32
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 10_000_000
    with torch.no_grad():
        logits = model(torch.tensor([[104, 105, 32, 261]])).logits
    assert logits.shape == (1, 4, 320)
    # Random but not degenerate: different positions prefer different tokens.
    assert len(set(logits[0].argmax(-1).tolist())) > 1


def test_vocabulary_is_bytes_then_special_tokens(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    assert len(tokenizer) == 320
    assert tokenizer.convert_tokens_to_ids(SPECIAL) == list(range(256, 262))
    assert tokenizer.convert_tokens_to_ids("<|reserved_0|>") == 262
    assert tokenizer.convert_tokens_to_ids("<|reserved_57|>") == 319
    assert tokenizer.bos_token == "<|begin_of_text|>" and tokenizer.eos_token == "<|end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips_as_one_token_per_byte(
    tokenizer: transformers.PreTrainedTokenizerBase, text: str
) -> None:
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.encode(text, add_special_tokens=True) == ids, "no BOS is added"
    assert tokenizer.decode(ids) == text


def test_tokenization_is_stable_under_concatenation(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    for a in TEXTS:
        for b in TEXTS:
            assert tokenizer.encode(a + b) == tokenizer.encode(a) + tokenizer.encode(b)


def test_every_id_decodes(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    for token_id in range(320):
        skipped = tokenizer.decode([token_id], skip_special_tokens=True)
        assert isinstance(skipped, str)
        if token_id >= 256:
            assert skipped == ""
            assert tokenizer.decode([token_id], skip_special_tokens=False).startswith("<|")


def test_chat_template_renders_roles_and_generation_prompt(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
        },
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|system|>\nBe brief.<|end|>\n"
        "<|user|>\nHi\nthere<|end|>\n"
        "<|assistant|>\nHello!<|end|>\n"
        "<|user|>\nBye<|end|>\n"
        "<|assistant|>\n"
    )
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == without_prompt + "<|assistant|>\n"
    ids = tokenizer.apply_chat_template(messages[:1], return_dict=False)
    system, end = tokenizer.convert_tokens_to_ids(["<|system|>", "<|end|>"])
    assert ids == [system, 10, *b"Be brief.", end, 10]


def test_chat_template_maps_developer_to_system_and_rejects_other_roles(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    rendered = tokenizer.apply_chat_template(
        [{"role": "developer", "content": "x"}], tokenize=False
    )
    assert rendered == "<|system|>\nx<|end|>\n"
    with pytest.raises(TemplateError, match="roles"):
        tokenizer.apply_chat_template([{"role": "function", "content": "x"}], tokenize=False)


def test_byte_tokenizer_size_is_configurable(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path, vocab_size=300)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert len(tokenizer) == 300
    with pytest.raises(ValueError, match="at least 262"):
        write_byte_tokenizer(tmp_path / "small", vocab_size=100)
