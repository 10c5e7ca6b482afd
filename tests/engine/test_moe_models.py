"""Mixtures of experts: what config.json says of them, what is refused, and how the loader stacks
the checkpoint's per-expert tensors (greedy ids against transformers: test_model_vs_hf.py,
test_tensor_parallel.py and tests/server/test_routes_vs_hf.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig, ModelError, check_model_folder, tensor_parallel_sizes
from engine.loader import load_model
from engine.parallel import TensorParallel
from tests.tiny_models import MOE_ARCHS, write_tiny_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {arch: write_tiny_model(tmp_path_factory.mktemp(arch), arch) for arch in MOE_ARCHS}


def copy_with(folder: Path, tmp_path: Path, **changes: object) -> Path:
    out = tmp_path / "model"
    out.mkdir()
    for f in folder.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_what_each_config_says(folders: dict[str, Path]) -> None:
    qwen = ModelConfig.from_folder(folders["qwen3_moe"])
    # 2 layers, the second dense (mlp_only_layers), 8 experts of width 32, 2 a token, renormalised
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (8, 2, 32)
    assert (qwen.moe_layers, qwen.norm_topk_prob, qwen.qk_norm) == ((0,), True, "head")
    mixtral = ModelConfig.from_folder(folders["mixtral"])
    assert (mixtral.moe_layers, mixtral.norm_topk_prob, mixtral.qk_norm) == ((0, 1), True, "")
    olmoe = ModelConfig.from_folder(folders["olmoe"])
    assert (olmoe.moe_layers, olmoe.norm_topk_prob, olmoe.qk_norm) == ((0, 1), False, "full")


def test_hub_configs_name_the_experts_num_experts(folders: dict[str, Path], tmp_path: Path) -> None:
    """Qwen3-30B-A3B's config.json says num_experts where transformers 5 writes
    num_local_experts."""
    folder = copy_with(folders["qwen3_moe"], tmp_path, num_local_experts=None, num_experts=8)
    assert ModelConfig.from_folder(folder).num_experts == 8


@pytest.mark.parametrize(
    ("model_type", "says"),
    [("qwen2_moe", "shared experts"), ("deepseek_v3", "MLA"), ("jamba", "Mamba")],
)
def test_unserved_variants_are_refused_naming_the_served(
    folders: dict[str, Path], tmp_path: Path, model_type: str, says: str
) -> None:
    folder = copy_with(folders["qwen3_moe"], tmp_path, model_type=model_type)
    with pytest.raises(ModelError, match=rf"{says}.*served: qwen3_moe, mixtral, olmoe"):
        check_model_folder(folder)


def test_shared_experts_are_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = copy_with(folders["qwen3_moe"], tmp_path, shared_expert_intermediate_size=64)
    with pytest.raises(ModelError, match="shared experts .*shared_expert_intermediate_size 64"):
        check_model_folder(folder)


def test_tensor_parallel_splits_every_expert(folders: dict[str, Path], tmp_path: Path) -> None:
    cfg = ModelConfig.from_folder(folders["qwen3_moe"])  # 4 heads, 2 KV heads, experts 32 wide
    assert tensor_parallel_sizes(cfg) == [1, 2, 4]
    assert cfg.sharded(4).moe_intermediate_size == 8
    # experts 18 wide: 4 ranks would split the heads but not the experts
    narrow = ModelConfig.from_folder(
        write_tiny_model(tmp_path, "qwen3_moe", moe_intermediate_size=18)
    )
    assert tensor_parallel_sizes(narrow) == [1, 2]
    with pytest.raises(ModelError, match="expert width 18\\): use one of 1, 2"):
        narrow.sharded(4)
    with pytest.raises(ModelError, match="q and k norms span every attention head"):
        ModelConfig.from_folder(folders["olmoe"]).sharded(2)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_stacked_experts_are_the_checkpoint_tensors(folders: dict[str, Path], arch: str) -> None:
    """w13[e] holds expert e's gate rows then its up rows, w2[e] its down projection; rank 1 of 2
    holds the second half of each expert's width."""
    folder = folders[arch]
    state = load_file(folder / "model.safetensors")
    p = "model.layers.0." + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
    gate, up, down = (
        ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    )
    whole, _ = load_model(folder)
    half, _ = load_model(folder, tp=TensorParallel(2, 1))
    for model, part in ((whole, slice(0, 32)), (half, slice(16, 32))):
        layer = model.model.layers[0].mlp
        assert torch.equal(layer.gate.weight, state[p + "gate.weight"])
        for e in range(8):
            w = f"{p}experts.{e}."
            stacked = torch.cat(
                (state[w + f"{gate}.weight"][part], state[w + f"{up}.weight"][part])
            )
            assert torch.equal(layer.w13[e], stacked)
            assert torch.equal(layer.w2[e], state[w + f"{down}.weight"][:, part])


def test_a_missing_expert_is_named(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = copy_with(folders["mixtral"], tmp_path)
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ModelError, match=r"missing tensors .*experts\.5\.w3\.weight"):
        check_model_folder(folder)
