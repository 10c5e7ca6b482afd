"""FP8 weights (engine/quant.py): quantizing and dequantizing against float64, the linear layer in
both modes, weight-only FP8 against transformers on the weights it stands for, and FP8 checkpoints
in each layout read as written."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig, ModelError
from engine.loader import arena_nbytes, bind_arena, build_model, kv_scales, load_model, load_weights
from engine.model import Model
from engine.model_runner import ModelRunner
from engine.quant import FP8, Fp8Weight, dense_copies, dequantize, fp8_linear, quantize
from tests.engine.test_model_vs_hf import Engine, Seq, random_ids
from tests.tiny_models import (
    ARCHS,
    FP8_LAYOUTS,
    hf_greedy,
    hf_logits,
    write_dequantized_model,
    write_fp8_checkpoint,
    write_tiny_model,
)

NEW_TOKENS = 10
# 12 s in Triton's interpreter on 2 cores: in the second suite (the per-row case in the default)
SLOW_CASES = [{"scales": "block"}]
# W8A8 against the weights it stands for, over the steps of transformers' greedy continuation: the
# logits' RMS difference at most this fraction of their standard deviation. e4m3 rounds each input
# to 2^-4 of itself; through these tiny random models' 2 layers the logits move by 10-14% of their
# spread (measured on the four architectures). Their best tokens are often near-ties (a spread of
# 1.3 over 320 tokens) that such a move decides either way, so free-running greedy ids part within
# a few tokens here; greedy agreement is measured on a real model (bench/fp8_agreement.py).
W8A8_TOLERANCE = 0.2


def spread(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Values over several orders of magnitude, some rows all small, one all zero: every e4m3
    range a scale meets (normal, subnormal, zero)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 1, rows)[:, None]
    w[1] = 0.0
    w[2, 5] = 300.0  # an outlier that sets its row's (or group's) scale
    return w


@pytest.mark.parametrize("group", [70, 16, 32])
def test_dequantize_is_exact_against_float64(group: int) -> None:
    w = spread(37, 70, seed=group)
    data, scale = quantize(w, group)
    assert data.dtype == FP8 and scale.dtype == torch.float32
    assert scale.shape == (37, -(-70 // group))
    # Each group's largest magnitude lands on e4m3's largest value (the all-zero row stays zero).
    groups = F.pad(data.float(), (0, -70 % group)).unflatten(1, (-1, group)).abs().amax(-1)
    nonzero = F.pad(w, (0, -70 % group)).unflatten(1, (-1, group)).abs().amax(-1) > 0
    assert torch.equal(groups[nonzero], torch.full_like(groups[nonzero], 448.0))
    assert torch.all(data[1].float() == 0)
    # The product data x scale in float64, rounded once to float32: what dequantize returns.
    full = scale.double().repeat_interleave(group, 1)[:, :70]
    reference = (data.double() * full).float()
    assert torch.equal(dequantize(data, scale, group), reference)
    # Within half of e4m3's step of each value: 2^-4 relative (3 mantissa bits), or 2^-10 of the
    # scale below e4m3's smallest normal (2^-6).
    error = (reference.double() - w.double()).abs()
    bound = torch.maximum(w.double().abs() * 2**-4, full * 2**-10)
    assert torch.all(error <= bound * (1 + 1e-6))


@pytest.mark.parametrize("group", [48, 16])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_fp8_linear_both_modes_against_float64(group: int, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=g)
    w, bias = spread(24, 48, seed=7), torch.randn(24, generator=g)
    data, scale = quantize(w, group)
    dense = dequantize(data, scale, group).double()
    # W8A16: the input times the weight it stands for.
    only = fp8_linear(x, Fp8Weight(data, scale, group, "none"), bias)
    torch.testing.assert_close(
        only.double(), x.double() @ dense.T + bias.double(), rtol=1e-5, atol=1e-5
    )
    # W8A8: the input quantized per token and group too; e4m3 products are exact in float32, so
    # only the sums' order and the final rounding differ from float64.
    xq, xs = quantize(x, group)
    inputs = dequantize(xq, xs, group).double()
    both = fp8_linear(x, Fp8Weight(data, scale, group, "dynamic"), bias)
    torch.testing.assert_close(
        both.double(), inputs @ dense.T + bias.double(), rtol=1e-5, atol=1e-5
    )
    # Over kept float32 copies of the weight (benchmarks on the CPU): the same sums, twice.
    with dense_copies():
        for _ in range(2):
            for mode, expected in (("none", only), ("dynamic", both)):
                got = fp8_linear(x, Fp8Weight(data, scale, group, mode), bias)
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def fp8_kv_engine(model: Model, folder: Path, backend: str = "torch") -> Engine:
    """The tests' engine over a KV pool in FP8 e4m3 (unwritten slots NaN, as Engine's), with the
    layers' scales the server computes (loader.kv_scales)."""
    engine = Engine(model, backend=backend)
    pool = torch.full_like(engine.runner.kv_pool, float("nan"), dtype=FP8)
    model.set_kv_scales(kv_scales(model, folder, "auto"))
    engine.runner = ModelRunner(model, pool, engine.block_size, backend)
    return engine


def forced_logits(
    model: Model, prompt: list[int], continuation: list[int], engine: Engine | None = None
) -> torch.Tensor:
    """The model's logits [len(continuation), vocab] at each step of generating continuation after
    prompt, fed continuation's tokens whatever it would have chosen (teacher forcing)."""
    engine, seq = engine or Engine(model), Seq(list(prompt))
    logits = []
    for token in continuation:
        logits.append(engine.runner.forward([engine.input_for(seq)])[0])
        seq.tokens.append(token)
    return torch.stack(logits)


def relative_rms(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """The logits' RMS difference from the reference over the reference's standard deviation."""
    return float((logits - reference).pow(2).mean().sqrt() / reference.std())


def greedy_and_logits(model: Model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    engine, seq = Engine(model), Seq(list(prompt))
    logits = [engine.step([seq])[0]]
    while len(seq.tokens) < len(prompt) + NEW_TOKENS:
        logits.append(engine.step([seq])[0])
    return seq.tokens[len(prompt) :], torch.stack(logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_weight_only_fp8_equals_transformers_on_the_dequantized_weights(
    arch: str, tmp_path: Path
) -> None:
    """--quantization fp8 with activations left alone (W8A16): the engine runs exactly the weights
    e4m3 with a scale per row stands for, so its greedy ids and logits are transformers' on
    them."""
    folder = write_tiny_model(tmp_path / arch, arch)
    plain = write_dequantized_model(folder, tmp_path / f"{arch}-dequantized")
    model, cfg = load_model(folder, quantization="fp8", fp8_activations="none")
    assert cfg.quantization is not None and cfg.quantization.source == "online"
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == FP8
    assert model.model.embed_tokens.weight.dtype == torch.float32  # not quantized
    for seed in (1, 2):
        prompt = random_ids(19, seed=seed)
        out, logits = greedy_and_logits(model, prompt)
        assert out == hf_greedy(plain, prompt, NEW_TOKENS)
        reference = hf_logits(plain, prompt + out[:-1])[len(prompt) - 1 :]
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", FP8_LAYOUTS)
def test_fp8_checkpoints_load_as_written(layout: str, tmp_path: Path) -> None:
    """FP8 checkpoints with a scale per tensor, per block (quant_method fp8) and per channel
    (compressed-tensors): weight-only, the engine equals transformers on the weights the file
    stands for; with activations quantized per token too (the default), within W8A8's tolerance
    of them (W8A8_TOLERANCE)."""
    source = write_tiny_model(tmp_path / "llama", "llama")
    folder, plain = write_fp8_checkpoint(source, tmp_path / f"fp8-{layout}", layout, block=32)
    cfg = ModelConfig.from_folder(folder)
    assert cfg.quantization is not None
    assert cfg.quantization.block == ((32, 32) if layout == "block" else None)
    weight_only, _ = load_model(folder, fp8_activations="none")
    both, _ = load_model(folder)
    for seed in (3, 4):
        prompt = random_ids(21, seed=seed)
        reference = hf_greedy(plain, prompt, NEW_TOKENS)
        out, logits = greedy_and_logits(weight_only, prompt)
        assert out == reference
        torch.testing.assert_close(
            logits, hf_logits(plain, prompt + out[:-1])[len(prompt) - 1 :], atol=1e-4, rtol=1e-4
        )
        expected = hf_logits(plain, prompt + reference[:-1])[len(prompt) - 1 :]
        assert relative_rms(forced_logits(both, prompt, reference), expected) <= W8A8_TOLERANCE


def test_fp8_weights_take_a_byte_a_value_and_their_scales(tmp_path: Path) -> None:
    """The arena holds each projection in one byte a value plus a float32 scale per row; the
    embeddings and norms as before."""
    folder = write_tiny_model(tmp_path / "llama", "llama")
    cfg = ModelConfig.from_folder(folder)
    plain = arena_nbytes(build_model(cfg, torch.float32))
    fp8 = arena_nbytes(build_model(cfg.quantized("fp8"), torch.float32))
    h, d, inter, layers = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.num_layers
    rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * d + h + 2 * inter + h
    values = (
        (cfg.num_heads + 2 * cfg.num_kv_heads) * d * h + h * cfg.num_heads * d
    ) + 3 * h * inter
    saved = layers * (values * 3 - rows * 4)  # float32's 4 bytes a value to 1, less the scales
    assert abs((plain - fp8) - saved) <= 64 * 12 * layers  # each parameter's alignment padding


def test_unserved_quantizations_are_refused_by_name(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "llama", "llama")
    cfg = ModelConfig.from_folder(folder)
    with pytest.raises(ModelError, match="--quantization awq: ppd serves fp8"):
        cfg.quantized("awq")
    moe = ModelConfig.from_folder(write_tiny_model(tmp_path / "moe", "qwen3_moe"))
    with pytest.raises(ModelError, match="mixture of experts"):
        moe.quantized("fp8")
    # A checkpoint quantized another way, and an FP8 one whose scales do not fit its weights.
    (tmp_path / "awq").mkdir()
    text = (folder / "config.json").read_text()
    (tmp_path / "awq" / "config.json").write_text(
        text.replace('"model_type"', '"quantization_config": {"quant_method": "awq"}, "model_type"')
    )
    with pytest.raises(ModelError, match="quantized with 'awq'; ppd serves FP8 checkpoints"):
        ModelConfig.from_folder(tmp_path / "awq")
    fp8, _ = write_fp8_checkpoint(folder, tmp_path / "fp8", "block", block=32)
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [16, 16]
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="weight_scale_inv has shape"):
        load_model(fp8)


@pytest.mark.parametrize("arch", ARCHS)
def test_w8a8_within_its_tolerance_of_the_dequantized_weights(arch: str, tmp_path: Path) -> None:
    """--quantization fp8 (activations quantized per token, as served by default) against
    transformers on the weights it stands for, over transformers' greedy continuations of three
    prompts."""
    folder = write_tiny_model(tmp_path / arch, arch)
    plain = write_dequantized_model(folder, tmp_path / f"{arch}-dequantized")
    model, _ = load_model(folder, quantization="fp8")
    for seed in (5, 6, 7):
        prompt = random_ids(17, seed=seed)
        reference = hf_greedy(plain, prompt, NEW_TOKENS)
        expected = hf_logits(plain, prompt + reference[:-1])[len(prompt) - 1 :]
        rms = relative_rms(forced_logits(model, prompt, reference), expected)
        assert 0.01 < rms <= W8A8_TOLERANCE  # above 0: the activations are quantized too


# FP8 KV against transformers: the logits' RMS difference at most this fraction of their standard
# deviation (measured 0.067-0.099 on the four architectures, two prompts each: keys and values
# rounded to 2^-4 of themselves; the scales from the weights' bounds leave the largest stored value
# at 176-208 of e4m3's 448).
FP8_KV_TOLERANCE = 0.15


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_kv_cache_within_its_tolerance_of_transformers(arch: str, tmp_path: Path) -> None:
    """--kv-cache-dtype fp8 (weights as the checkpoint's): a prompt, then decode, against
    transformers' logits over its greedy continuation; no stored key or value saturates (the
    scales bound what the layer can produce)."""
    folder = write_tiny_model(tmp_path / arch, arch)
    model, _ = load_model(folder)
    engine = fp8_kv_engine(model, folder)
    for seed in (8, 9):
        prompt = random_ids(23, seed=seed)
        reference = hf_greedy(folder, prompt, NEW_TOKENS)
        expected = hf_logits(folder, prompt + reference[:-1])[len(prompt) - 1 :]
        rms = relative_rms(forced_logits(model, prompt, reference, engine), expected)
        assert 0 < rms <= FP8_KV_TOLERANCE
    written = engine.runner.kv_pool.float()
    written = written[~written.isnan()]
    assert written.numel() and written.abs().max() < 448


@pytest.mark.parametrize("scales", ["row", "block"])
def test_the_gpu_path_computes_what_the_torch_path_does(scales: str, tmp_path: Path) -> None:
    """The Triton backend (in Triton's interpreter: the GPU's kernels) with FP8 weights, activations
    quantized per token, and an FP8 KV cache: a prompt, then decode, equals the torch backend's
    logits but for the order of float32 sums (and so, now and then, one e4m3 rounding of a stored
    key or value the other way)."""
    source = write_tiny_model(tmp_path / "llama", "llama")
    if scales == "block":  # block scales: the Triton GEMM applies each group's
        folder, _ = write_fp8_checkpoint(source, tmp_path / "fp8", "block", block=32)
        model, _ = load_model(folder)
    else:  # a scale per row: the activation quantizer, then _scaled_mm's math
        folder = source
        model, _ = load_model(folder, quantization="fp8")
    prompt = random_ids(19, seed=10)
    continuation = greedy_and_logits(model, prompt)[0][:6]
    torch_path = forced_logits(model, prompt, continuation, fp8_kv_engine(model, folder))
    triton_path = forced_logits(
        model, prompt, continuation, fp8_kv_engine(model, folder, backend="triton")
    )
    assert relative_rms(triton_path, torch_path) < 1e-3
    assert torch.equal(triton_path.argmax(-1), torch_path.argmax(-1))


def cuda_or_skip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["row", "block"])
def test_fp8_on_cuda_computes_what_the_cpu_does(layout: str, tmp_path: Path) -> None:
    """On the GPU (compute capability 8.9 or later), bfloat16 with FP8 weights (a scale per row:
    the activation quantizer and torch._scaled_mm; 32 x 32 blocks: our FP8 GEMM) and an FP8 KV
    cache: teacher-forced logits within 2% (RMS, of their spread) of the CPU's torch path on the
    same weights, and the same argmax at 5 of 6 steps at least (bfloat16's rounding differs by
    device)."""
    cuda_or_skip()
    source = write_tiny_model(tmp_path / "llama", "llama")
    folder, kwargs = source, {"quantization": "fp8"}
    if layout == "block":
        folder = write_fp8_checkpoint(source, tmp_path / "fp8", "block", block=32)[0]
        kwargs = {}
    cpu, _ = load_model(folder, "bfloat16", **kwargs)
    gpu, _ = load_model(folder, "bfloat16", device="cuda", **kwargs)
    prompt = random_ids(19, seed=11)
    continuation = greedy_and_logits(cpu, prompt)[0][:6]
    on_cpu = forced_logits(cpu, prompt, continuation, fp8_kv_engine(cpu, folder))
    engine = Engine(gpu, device="cuda", backend="triton")
    pool = torch.zeros_like(engine.runner.kv_pool, dtype=FP8)
    gpu.set_kv_scales(kv_scales(gpu, folder, "auto"))
    engine.runner = ModelRunner(gpu, pool, engine.block_size, "triton")
    on_gpu = forced_logits(gpu, prompt, continuation, engine).cpu()
    assert relative_rms(on_gpu, on_cpu) < 0.02
    assert (on_gpu.argmax(-1) == on_cpu.argmax(-1)).sum() >= 5


@pytest.mark.gpu
def test_weight_only_fp8_on_cuda_equals_transformers(tmp_path: Path) -> None:
    """float32 on the GPU with weight-only FP8 (our FP8 GEMM converting each e4m3 tile): greedy ids
    are transformers' on the dequantized weights."""
    cuda_or_skip()
    folder = write_tiny_model(tmp_path / "qwen3", "qwen3")
    plain = write_dequantized_model(folder, tmp_path / "dequantized")
    model, _ = load_model(folder, device="cuda", quantization="fp8", fp8_activations="none")
    prompt = random_ids(23, seed=12)
    engine, seq = Engine(model, device="cuda", backend="triton"), Seq(list(prompt))
    assert engine.generate(seq, NEW_TOKENS) == hf_greedy(plain, prompt, NEW_TOKENS)


def test_layers_a_checkpoint_keeps_unquantized_stay_in_the_model_dtype(tmp_path: Path) -> None:
    """A checkpoint's ignored layers (here one layer's k_proj and gate_proj, by name and by
    compressed-tensors' `re:` pattern) stay in float32 beside FP8 neighbours: q/k/v and gate/up
    then run as separate GEMMs, and weight-only FP8 still equals transformers."""
    folder = write_tiny_model(tmp_path / "llama", "llama")
    plain = write_dequantized_model(folder, tmp_path / "dequantized")
    ignored = ("model.layers.0.self_attn.k_proj", "re:model\\.layers\\.1\\.mlp\\.gate_proj")
    cfg = ModelConfig.from_folder(folder).quantized("fp8", "none")
    assert cfg.quantization is not None
    cfg = replace(cfg, quantization=replace(cfg.quantization, ignored=ignored))
    model = build_model(cfg, torch.float32)
    bind_arena(model, torch.empty(arena_nbytes(model), dtype=torch.uint8))
    load_weights(model, folder)
    first, second = model.model.layers
    assert first.self_attn.k_proj.weight.dtype == torch.float32
    assert first.self_attn.q_proj.weight.dtype == FP8 and first.self_attn.fused_qkv() is None
    assert second.mlp.gate_proj.weight.dtype == torch.float32 and second.mlp.gate_up_weight is None
    # transformers' model with the ignored layers' original weights and the rest dequantized
    mixed = write_tiny_model(tmp_path / "mixed", "llama")
    original, quantized = (
        load_file(folder / "model.safetensors"),
        load_file(plain / "model.safetensors"),
    )
    names = ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.gate_proj.weight")
    save_file(
        {n: original[n] if n in names else t for n, t in quantized.items()},
        mixed / "model.safetensors",
    )
    prompt = random_ids(21, seed=13)
    assert greedy_and_logits(model, prompt)[0] == hf_greedy(mixed, prompt, NEW_TOKENS)
