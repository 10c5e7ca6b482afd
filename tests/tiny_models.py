"""Tiny random Hugging Face model folders and the Hugging Face greedy oracle, for tests."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# Mixtures of experts: 8 experts of width 32, 2 a token; Qwen3-MoE's second layer dense
# (mlp_only_layers), its chosen experts' weights renormalised as Qwen3-30B-A3B's are, OLMoE's not.
MOE_ARCHS = ("qwen3_moe", "mixtral", "olmoe")

# Each architecture exercises its own features; all use GQA (fewer KV heads than query heads).
_CONFIGS: dict[str, tuple[type, dict[str, Any]]] = {
    "llama": (
        LlamaConfig,
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            "rope_theta": 50000.0,
            # original_max_position_embeddings 128 puts this head_dim's frequencies in all three
            # llama3 bands.
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
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "tie_word_embeddings": False,
            "sliding_window": 160,
        },
    ),
    "qwen2": (
        Qwen2Config,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False},
    ),
    "qwen3": (
        Qwen3Config,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 24,
            "tie_word_embeddings": False,
        },
    ),
    "qwen3_moe": (
        Qwen3MoeConfig,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 24,
            "tie_word_embeddings": False,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
        },
    ),
    "mixtral": (
        MixtralConfig,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
        },
    ),
    "olmoe": (
        OlmoeConfig,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "tie_word_embeddings": False,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "norm_topk_prob": False,
        },
    ),
}


def write_tiny_model(
    folder: str | Path, arch: str, seed: int = 0, vocab_size: int = 320, **overrides: Any
) -> Path:
    """Save a tiny random float32 `arch` model to folder (config.json, generation_config.json,
    model.safetensors)."""
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
    )
    kwargs.update(arch_kwargs)
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # transformers initialises norms to ones and biases to zeros; randomise them so loading them
        # is tested.
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
        model = AutoModelForCausalLM.from_pretrained(
            key, dtype=torch.float32, attn_implementation="eager"
        )
        _HF_MODELS[key] = model.eval()
    return _HF_MODELS[key]


@torch.no_grad()
def hf_logits(folder: str | Path, ids: list[int]) -> torch.Tensor:
    """Hugging Face float32 logits [len(ids), vocab] for one sequence."""
    return hf_model(folder)(torch.tensor([ids])).logits[0].float()


def hf_greedy(folder: str | Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: Hugging Face greedy decoding without a KV cache (full recompute each step); new
    ids only."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(hf_logits(folder, ids)[-1].argmax()))
    return ids[len(prompt_ids) :]


def assert_prompt_logprobs(
    folder: str | Path, prompt_ids: list[int], shown: list, top: int
) -> None:
    """shown (vLLM's prompt_logprobs: None, then {token id: {logprob, rank, decoded_token}} per
    prompt token) equals transformers' log-softmax at the position before each token (float32,
    1e-4): the token's own logprob and rank, then the top alternatives."""
    assert len(shown) == len(prompt_ids) and shown[0] is None
    ref = hf_logits(folder, prompt_ids)[:-1].log_softmax(-1)
    for i, token in enumerate(prompt_ids[1:]):
        entry, row = shown[i + 1], ref[i]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert (
            int((row > row[token] + 1e-4).sum()) + 1
            <= own["rank"]
            <= int((row > row[token] - 1e-4).sum()) + 1
        )
        alternatives = sorted(
            (v["logprob"] for v in entry.values() if v["rank"] <= top), reverse=True
        )
        assert alternatives == pytest.approx(row.topk(top).values.tolist(), abs=1e-4)


_GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",  # llama.cpp writes Mixtral as llama with experts
}
_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
}
# Each expert's projection, by the Hugging Face name's last part, as llama.cpp's stacked tensor
_GGUF_EXPERTS = {
    "gate_proj": "ffn_gate_exps",
    "w1": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "w3": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w2": "ffn_down_exps",
}


def stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """state with each layer's per-expert projections stacked into one [E, rows, cols] tensor under
    llama.cpp's layer-relative name (`{layer}.ffn_gate_exps.weight`, ...), as its converter
    writes a mixture of experts; the other tensors as they are."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in state.items():
        if ".experts." not in key:
            out[key] = tensor
            continue
        layer = key.removeprefix("model.layers.").split(".", 1)[0]
        expert, part = key.split(".experts.", 1)[1].split(".")[:2]
        experts.setdefault(f"{layer}.{_GGUF_EXPERTS[part]}.weight", {})[int(expert)] = tensor
    for name, per_expert in experts.items():
        out[name] = torch.stack([per_expert[e] for e in sorted(per_expert)])
    return out


def llama_cpp_rope_divisors(cfg: dict[str, Any]) -> list[float] | None:
    """The rope_freqs tensor llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel) writes for a
    Llama 3 rope_scaling: a divisor per RoPE frequency, 1 above orig / high_freq_factor cycles a
    token, `factor` below orig / low_freq_factor, smoothly between. None without llama3 scaling."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type") != "llama3":
        return None
    theta = float(rope.get("rope_theta") or cfg.get("rope_theta"))
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    divisors = []
    for freq in 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return divisors


# Where each K-quant block (256 weights) keeps its float16 scales (ggml-common.h: block_q2_K ...
# block_q6_K); every other byte (sub-block scales, quants, high bits) is valid whatever its value.
_K_QUANT_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def k_quant_blocks(
    rows: int, cols: int, quant: str, rng: np.random.Generator, std: float = 0.1
) -> np.ndarray:
    """A rows x cols weight in K-quant `quant` as the raw blocks a GGUF holds (the gguf package
    reads K-quants but cannot write them): random bytes, each block's float16 scales drawn and
    then scaled (the weights are linear in them) to give the weights a standard deviation of
    `std`, a trained layer's spread."""
    import gguf
    from gguf.quants import dequantize

    qtype = gguf.GGMLQuantizationType[quant]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert cols % block == 0, f"a K-quant row holds whole blocks of {block}"
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scales = {
        offset: rng.uniform(0.5, 1.5, size=(rows, cols // block))
        for offset in _K_QUANT_SCALES[quant]
    }

    def write(spread: float) -> np.ndarray:
        for offset, scale in scales.items():
            raw[:, :, offset : offset + 2] = (
                (scale * spread).astype(np.float16)[..., None].view(np.uint8)
            )
        return raw.reshape(rows, -1)

    return write(std / float(dequantize(write(1.0), qtype).std()))


def write_tiny_gguf(path: str | Path, arch: str, quant: str = "F32", **overrides: Any) -> Path:
    """A tiny random `arch` model as a GGUF file, as llama.cpp's converter writes one: its metadata,
    a byte-level gpt2 tokenizer (the demo's) with a chat template, tensors under llama.cpp's
    names, Llama's q and k rows permuted, Llama 3's RoPE scaling as the rope_freqs tensor, 2-D
    weights in `quant` (F32, F16, Q8_0, or K-quants: a comma-separated list is cycled over the
    weights, as a Q4_K_M file mixes Q4_K and Q6_K; norms and biases stay F32). K-quant weights
    are random blocks, not the model's (see k_quant_blocks), and need widths that are multiples
    of 256 (`overrides` of the model's config). Qwen3's head_dim is 128, as in every Qwen3:
    transformers' GGUF reader takes no other."""
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file

    from engine.demo import CHAT_TEMPLATE, NUM_BYTES, _bytes_to_unicode, _special_tokens

    path = Path(path)
    folder = write_tiny_model(
        path.parent / f"{path.stem}-hf",
        arch,
        **({"head_dim": 128} if arch in ("qwen3", "qwen3_moe") else {}),
        **overrides,
    )
    cfg = __import__("json").loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    name = _GGUF_ARCH[arch]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), name)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(
        float((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta"))
    )
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_key_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    writer.add_value_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    byte_chars = _bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(NUM_BYTES)] + _special_tokens(cfg["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * NUM_BYTES + [3] * (len(tokens) - NUM_BYTES))
    writer.add_token_merges([])
    writer.add_token_scores(
        [0.0] * len(tokens)
    )  # transformers reads merges from scores when there are none
    if experts := cfg.get("num_experts") or cfg.get("num_local_experts"):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        if arch == "qwen3_moe":
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_chat_template(CHAT_TEMPLATE)
    quants, weights, rng = quant.split(","), 0, np.random.default_rng(0)
    qtype = gguf.GGMLQuantizationType[quants[0]]
    if name == "llama" and (divisors := llama_cpp_rope_divisors(cfg)) is not None:
        writer.add_tensor("rope_freqs.weight", np.array(divisors, dtype=np.float32))
    for key, tensor in stacked_experts(state).items():
        data = tensor.float().numpy()
        if not key.startswith(("model.", "lm_head")):  # a layer's stacked experts
            gname = f"blk.{key}"
        elif key == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif key == "model.norm.weight":
            gname = "output_norm.weight"
        elif key == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = key.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"
            if name == "llama" and module in (
                "self_attn.q_proj",
                "self_attn.k_proj",
            ):  # llama.cpp's permute
                n = heads if module == "self_attn.q_proj" else kv_heads
                data = (
                    data.reshape(n, 2, data.shape[0] // n // 2, *data.shape[1:])
                    .swapaxes(1, 2)
                    .reshape(data.shape)
                )
        if data.ndim == 2 and quants[0] in _K_QUANT_SCALES:
            kind = quants[weights % len(quants)]
            weights += 1
            writer.add_tensor(
                gname,
                k_quant_blocks(*data.shape, kind, rng),
                raw_dtype=gguf.GGMLQuantizationType[kind],
            )
        elif data.ndim >= 2 and quant != "F32":  # stacked experts too
            writer.add_tensor(
                gname,
                quantize(data.astype("float16" if quant == "F16" else "float32"), qtype),
                raw_dtype=qtype,
            )
        else:
            writer.add_tensor(gname, data.astype("float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_gguf_model(path: str | Path) -> PreTrainedModel:
    """transformers' own reading of a GGUF file (float32, eager attention), cached per file, with
    the file's RoPE divisors (rope_freqs) applied as llama.cpp applies them: transformers' GGUF
    reader drops them."""
    import gguf

    path = Path(path)
    key = str(path.resolve())
    if key not in _HF_MODELS:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
        )
        divisors = [t for t in gguf.GGUFReader(path).tensors if t.name == "rope_freqs.weight"]
        if divisors:
            model.model.rotary_emb.inv_freq /= torch.from_numpy(
                divisors[0].data.astype("float32").reshape(-1)
            )
        _HF_MODELS[key] = model.eval()
    return _HF_MODELS[key]


FP8_LAYOUTS = ("tensor", "block", "channel")
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_fp8_checkpoint(
    source: str | Path, folder: str | Path, layout: str, block: int = 32
) -> tuple[Path, Path]:
    """source's model with its attention and MLP projections in FP8 e4m3, written as a checkpoint
    of `layout`: "tensor" (quant_method fp8, a `weight_scale` per tensor), "block" (quant_method
    fp8, `weight_scale_inv` per block x block tile, as DeepSeek's and Qwen's FP8 checkpoints) or
    "channel" (compressed-tensors, a `weight_scale` per output row); and beside it the weights it
    stands for (each e4m3 value times its scale, float32) as a plain checkpoint transformers reads.
    Returns (the FP8 folder, the dequantized folder). Written here with plain torch, independent of
    engine/quant.py."""
    import json

    from safetensors.torch import load_file, save_file

    source, folder = Path(source), Path(folder)
    plain = folder.with_name(folder.name + "-dequantized")
    for out in (folder, plain):
        out.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if f.suffix != ".safetensors":
                (out / f.name).write_bytes(f.read_bytes())
    state = load_file(source / "model.safetensors")
    fp8, dequantized = {}, {}
    for name, w in state.items():
        if name.rsplit(".", 2)[-2] not in _LINEAR or not name.endswith(".weight"):
            fp8[name] = dequantized[name] = w
            continue
        w = w.float()
        n, k = w.shape
        if layout == "block":
            padded = torch.nn.functional.pad(w, (0, -k % block, 0, -n % block))
            tiles = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [R, b, C, b]
            scale = tiles.abs().amax(dim=(1, 3)) / 448.0  # [R, C]
            full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
            fp8[name.replace(".weight", ".weight_scale_inv")] = scale
        elif layout == "channel":
            scale = w.abs().amax(dim=1, keepdim=True) / 448.0  # [N, 1]
            full = scale.expand(n, k)
            fp8[name.replace(".weight", ".weight_scale")] = scale
        else:
            scale = w.abs().amax() / 448.0
            full = scale.expand(n, k)
            fp8[name.replace(".weight", ".weight_scale")] = scale.reshape(())
        data = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        fp8[name] = data
        dequantized[name] = data.double().mul(full.double()).float()
    save_file(fp8, folder / "model.safetensors")
    save_file(dequantized, plain / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    if layout == "channel":
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "token",
                        "dynamic": True,
                    },
                }
            },
            "ignore": ["lm_head"],
        }
    else:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        if layout == "block":
            config["quantization_config"]["weight_block_size"] = [block, block]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder, plain


def write_dequantized_model(source: str | Path, folder: str | Path) -> Path:
    """source's model with each attention and MLP projection replaced by what FP8 with a scale per
    output row (--quantization fp8) stands for: e4m3(w / s) x s, s = the row's absolute maximum /
    448, float32; what transformers runs to check the engine's weight-only FP8."""
    from safetensors.torch import load_file, save_file

    source, folder = Path(source), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    state = load_file(source / "model.safetensors")
    for name, w in state.items():
        if name.rsplit(".", 2)[-2] in _LINEAR and name.endswith(".weight"):
            scale = (w.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
            data = (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            state[name] = data.double().mul(scale.double()).float()
    save_file(state, folder / "model.safetensors")
    return folder
