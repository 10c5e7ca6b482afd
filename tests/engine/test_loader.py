"""Model folder checks, config normalisation and the shared weight arena."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import config
from engine.config import ModelConfig, ModelError, check_model_folder, resolve_dtype, weight_shapes
from engine.loader import arena_nbytes, bind_arena, build_model, load_model, load_weights
from engine.model import Model, kv_pool_shape
from engine.model_runner import ModelRunner, StepInput
from tests.tiny_models import ARCHS, write_tiny_model


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def llama_copy(llama_folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(llama_folder, tmp_path / "model"))


def edit_json(path: Path, **changes: object) -> dict:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(changes)
    path.write_text(json.dumps(data))
    return data


def last_logits(model: Model, ids: list[int]) -> torch.Tensor:
    pool = torch.zeros(kv_pool_shape(model.cfg, 4, 16), dtype=model.dtype)
    return ModelRunner(model, pool, 16).forward([StepInput(ids, 0, [0, 1, 2, 3])])[0]


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        check_model_folder(tmp_path / "nope")


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no config.json"):
        check_model_folder(tmp_path)


def test_unsupported_architecture_names_the_supported_ones(llama_copy: Path) -> None:
    edit_json(llama_copy / "config.json", model_type="gpt2")
    with pytest.raises(ModelError, match=r"'gpt2'; supported: llama, mistral, qwen2, qwen3"):
        check_model_folder(llama_copy)


def test_unsupported_rope_scaling(llama_copy: Path) -> None:
    edit_json(
        llama_copy / "config.json",
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
    )
    with pytest.raises(ModelError, match="'yarn'"):
        check_model_folder(llama_copy)


def test_missing_tensor_is_named(llama_copy: Path) -> None:
    gone = "model.layers.1.mlp.down_proj.weight"
    tensors = load_file(llama_copy / "model.safetensors")
    del tensors[gone]
    save_file(tensors, llama_copy / "model.safetensors")
    with pytest.raises(ModelError, match=gone):
        check_model_folder(llama_copy)
    model = build_model(ModelConfig.from_folder(llama_copy), torch.float32)
    bind_arena(model, torch.empty(arena_nbytes(model), dtype=torch.uint8))
    with pytest.raises(ModelError, match=gone):
        load_weights(model, llama_copy)


def test_extra_tensors_are_ignored(llama_copy: Path, llama_folder: Path) -> None:
    tensors = load_file(llama_copy / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, llama_copy / "model.safetensors")
    check_model_folder(llama_copy)
    ids = [5, 6, 7]
    torch.testing.assert_close(
        last_logits(load_model(llama_copy)[0], ids), last_logits(load_model(llama_folder)[0], ids)
    )


def test_shape_mismatch_is_reported(llama_copy: Path) -> None:
    edit_json(llama_copy / "config.json", intermediate_size=96)
    with pytest.raises(ModelError, match="does not match the weights"):
        check_model_folder(llama_copy)


def test_dtype_names(llama_folder: Path) -> None:
    cfg = ModelConfig.from_folder(llama_folder)
    assert resolve_dtype("auto", cfg) == torch.float32
    assert (
        resolve_dtype("auto", cfg, "cuda") == torch.bfloat16
    )  # a float32 checkpoint runs in bf16 on a GPU
    assert resolve_dtype("float32", cfg, "cuda") == torch.float32
    assert resolve_dtype("bfloat16", cfg) == torch.bfloat16
    with pytest.raises(ModelError, match="unknown dtype 'float64'"):
        resolve_dtype("float64", cfg)
    model, _ = load_model(llama_folder, dtype_name="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


AVX2_ONLY = {"sse4_2", "avx", "avx2", "fma", "f16c"}  # an EPYC of Zen 2 or 3: no native bfloat16


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_auto_serves_a_16_bit_checkpoint_in_float32_on_a_cpu_without_native_bfloat16(
    llama_folder: Path, stored: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    """Where PyTorch's bfloat16 matmuls are slow, auto picks float32 and the log says why and how to
    keep bfloat16; with avx512_bf16 or amx_bf16 it keeps the checkpoint's dtype; a GPU's dtype does
    not depend on its host CPU."""
    cfg = dataclasses.replace(ModelConfig.from_folder(llama_folder), dtype=stored)
    config._say.cache_clear()
    with caplog.at_level(logging.INFO, logger="ppd.engine"):
        assert resolve_dtype("auto", cfg, "cpu", AVX2_ONLY) == torch.float32
        assert resolve_dtype("auto", cfg, "cpu", AVX2_ONLY) == torch.float32
    said = [r.getMessage() for r in caplog.records if "dtype auto" in r.getMessage()]
    assert len(said) == 1  # once a process
    assert all(
        w in said[0]
        for w in ("no native bfloat16", "avx512_bf16", "amx_bf16", "float32", "--dtype bfloat16")
    )
    assert resolve_dtype("auto", cfg, "cpu", AVX2_ONLY | {"avx512f", "avx512_bf16"}) == stored
    assert resolve_dtype("auto", cfg, "cpu", AVX2_ONLY | {"amx_bf16"}) == stored
    assert resolve_dtype("auto", cfg, "cuda", AVX2_ONLY) == stored
    assert (
        resolve_dtype("auto", dataclasses.replace(cfg, dtype=torch.float32), "cpu", AVX2_ONLY)
        == torch.float32
    )


def test_bfloat16_asked_for_is_served_in_bfloat16_on_any_cpu(
    llama_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--dtype bfloat16 is honoured without native bfloat16, and the log says how it runs there and
    what it costs."""
    cfg = dataclasses.replace(ModelConfig.from_folder(llama_folder), dtype=torch.bfloat16)
    config._say.cache_clear()
    with caplog.at_level(logging.INFO, logger="ppd.engine"):
        assert resolve_dtype("bfloat16", cfg, "cpu", AVX2_ONLY) == torch.bfloat16
        assert resolve_dtype("bfloat16", cfg, "cpu", AVX2_ONLY | {"amx_bf16"}) == torch.bfloat16
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "--dtype bfloat16 on a CPU without native bfloat16" in said[0]
    assert "float32 copy of each weight" in said[0]


def test_dummy_weights_need_no_safetensors(llama_folder: Path, tmp_path: Path) -> None:
    shutil.copy(llama_folder / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelError, match="dummy"):
        check_model_folder(tmp_path)
    check_model_folder(tmp_path, load_format="dummy")
    first, _ = load_model(tmp_path, load_format="dummy")
    second, _ = load_model(tmp_path, load_format="dummy")
    for (name, p), q in zip(first.named_parameters(), second.parameters()):
        assert torch.equal(p, q), f"dummy weights are not deterministic: {name}"
        if name.endswith("norm.weight"):
            assert torch.all(p == 1)
        else:
            assert 0.01 < p.std() < 0.04
    assert torch.isfinite(last_logits(first, [3, 4, 5])).all()


def test_unknown_load_format(llama_folder: Path) -> None:
    with pytest.raises(ModelError, match="unknown load format"):
        check_model_folder(llama_folder, load_format="pt")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_legacy_rope_keys_give_the_same_config(arch: str, tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / arch, arch)
    new_form = ModelConfig.from_folder(folder)
    raw = json.loads((folder / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    assert "rope_theta" in rope
    raw["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type") != "default":
        raw["rope_scaling"] = rope
    (folder / "config.json").write_text(json.dumps(raw))
    legacy = ModelConfig.from_folder(folder)
    assert legacy == new_form
    assert (legacy.rope_scaling is not None) == (arch == "llama")


def test_eos_ids_are_the_union_of_config_and_generation_config(llama_copy: Path) -> None:
    edit_json(llama_copy / "config.json", eos_token_id=[2, 5])
    edit_json(llama_copy / "generation_config.json", eos_token_id=[5, 7, 9])
    assert sorted(ModelConfig.from_folder(llama_copy).eos_token_ids) == [2, 5, 7, 9]
    edit_json(llama_copy / "config.json", eos_token_id=2)
    (llama_copy / "generation_config.json").unlink()
    assert ModelConfig.from_folder(llama_copy).eos_token_ids == (2,)


def test_sliding_window_caps_the_context(tmp_path: Path) -> None:
    mistral = ModelConfig.from_folder(
        write_tiny_model(tmp_path / "m", "mistral", sliding_window=100)
    )
    assert mistral.sliding_window == 100 and mistral.max_position_embeddings == 100
    qwen2 = ModelConfig.from_folder(write_tiny_model(tmp_path / "q", "qwen2", sliding_window=100))
    assert qwen2.sliding_window is None and qwen2.max_position_embeddings == 256
    folder = write_tiny_model(tmp_path / "w", "qwen2", sliding_window=100, use_sliding_window=True)
    assert ModelConfig.from_folder(folder).max_position_embeddings == 100


@pytest.mark.parametrize("arch", ARCHS)
def test_model_parameters_are_the_checkpoint_tensors(arch: str, tmp_path: Path) -> None:
    cfg = check_model_folder(write_tiny_model(tmp_path, arch))
    params = {
        name: tuple(p.shape) for name, p in build_model(cfg, torch.float32).named_parameters()
    }
    assert params == weight_shapes(cfg)
    assert ("lm_head.weight" in params) == (not cfg.tie_word_embeddings)


def test_every_parameter_lies_in_the_arena_aligned(llama_folder: Path) -> None:
    model = build_model(ModelConfig.from_folder(llama_folder), torch.float32)
    arena = torch.empty(arena_nbytes(model), dtype=torch.uint8)
    bind_arena(model, arena)
    start, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
    total = 0
    for name, p in model.named_parameters():
        assert start <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= end, name
        assert p.data_ptr() % 64 == 0, name
        total += p.numel() * p.element_size()
    assert total <= arena.numel()


def test_two_models_bound_to_one_arena_share_weights(llama_folder: Path) -> None:
    cfg = ModelConfig.from_folder(llama_folder)
    arena = torch.empty(arena_nbytes(build_model(cfg, torch.float32)), dtype=torch.uint8)
    owner, _ = load_model(llama_folder, arena=arena)
    # What the second process does: bind its own model to the same memory, load nothing.
    mapped = build_model(cfg, torch.float32)
    bind_arena(mapped, arena)
    ids = [9, 8, 7, 6]
    torch.testing.assert_close(last_logits(mapped, ids), last_logits(owner, ids), atol=0, rtol=0)
    owner.model.norm.weight.mul_(2.0)
    assert torch.equal(mapped.model.norm.weight, owner.model.norm.weight)
    for p, q in zip(owner.parameters(), mapped.parameters()):
        assert p.data_ptr() == q.data_ptr()
