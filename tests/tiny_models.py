"""Tiny random Hugging Face model folders and the Hugging Face greedy oracle, for tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedModel, Qwen2Config, Qwen3Config

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

# Each architecture exercises its own features; all use GQA (fewer KV heads than query heads).
_CONFIGS: dict[str, tuple[type, dict[str, Any]]] = {
    "llama": (
        LlamaConfig,
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            "rope_theta": 50000.0,
            # original_max_position_embeddings 128 puts this head_dim's frequencies in all three llama3 bands.
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        },
    ),
    "mistral": (
        MistralConfig,
        {"num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": False, "sliding_window": 160},
    ),
    "qwen2": (Qwen2Config, {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}),
    "qwen3": (
        Qwen3Config,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "tie_word_embeddings": False},
    ),
}


def write_tiny_model(folder: str | Path, arch: str, seed: int = 0, vocab_size: int = 320, **overrides: Any) -> Path:
    """Save a tiny random float32 `arch` model to folder (config.json, generation_config.json, model.safetensors)."""
    config_cls, arch_kwargs = _CONFIGS[arch]
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        # Large enough that greedy choices are decided by clear margins, not float noise.
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        **arch_kwargs,
    )
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # transformers initialises norms to ones and biases to zeros; randomise them so loading them is tested.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.15)
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder


_HF_MODELS: dict[str, PreTrainedModel] = {}


def hf_model(folder: str | Path) -> PreTrainedModel:
    """The folder's model loaded by transformers in float32 (eager attention), cached per folder."""
    key = str(Path(folder).resolve())
    if key not in _HF_MODELS:
        model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32, attn_implementation="eager")
        _HF_MODELS[key] = model.eval()
    return _HF_MODELS[key]


@torch.no_grad()
def hf_logits(folder: str | Path, ids: list[int]) -> torch.Tensor:
    """Hugging Face float32 logits [len(ids), vocab] for one sequence."""
    return hf_model(folder)(torch.tensor([ids])).logits[0].float()


def hf_greedy(folder: str | Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: Hugging Face greedy decoding without a KV cache (full recompute each step); new ids only."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(hf_logits(folder, ids)[-1].argmax()))
    return ids[len(prompt_ids) :]


def assert_prompt_logprobs(folder: str | Path, prompt_ids: list[int], shown: list, top: int) -> None:
    """shown (vLLM's prompt_logprobs: None, then {token id: {logprob, rank, decoded_token}} per prompt token) equals
    transformers' log-softmax at the position before each token (float32, 1e-4): the token's own logprob and rank,
    then the top alternatives."""
    assert len(shown) == len(prompt_ids) and shown[0] is None
    ref = hf_logits(folder, prompt_ids)[:-1].log_softmax(-1)
    for i, token in enumerate(prompt_ids[1:]):
        entry, row = shown[i + 1], ref[i]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert int((row > row[token] + 1e-4).sum()) + 1 <= own["rank"] <= int((row > row[token] - 1e-4).sum()) + 1
        alternatives = sorted((v["logprob"] for v in entry.values() if v["rank"] <= top), reverse=True)
        assert alternatives == pytest.approx(row.topk(top).values.tolist(), abs=1e-4)
