"""The model folder's config.json, read into one dataclass, and every check that needs no weights
loaded."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.cpu_isa import NATIVE_BF16_FLAGS, has_native_bf16
from engine.quant import ACTIVATIONS, QUANTIZATIONS, Fp8Scheme, QuantError, scheme_from_config

log = logging.getLogger("ppd.engine")

DENSE_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
MOE_ARCHS = ("qwen3_moe", "mixtral", "olmoe")
SUPPORTED_ARCHS = DENSE_ARCHS + MOE_ARCHS
# Mixture-of-experts variants that are not served, and what they have that ppd-serve lacks.
UNSERVED_MOE = {
    "qwen2_moe": "shared experts",
    "deepseek_v2": "multi-head latent attention (MLA) and shared experts",
    "deepseek_v3": "multi-head latent attention (MLA) and shared experts",
    "kimi_k2": "multi-head latent attention (MLA) and shared experts",
    "glm4_moe": "shared experts",
    "qwen3_next": "linear attention and shared experts",
    "llama4": "shared experts and chunked attention",
    "gpt_oss": "attention sinks and biased experts",
    "granitemoe": "scaled residuals and embeddings",
    "phimoe": "sparsemixer routing",
    "dbrx": "fused attention projections and clipped qkv",
    "jamba": "Mamba layers",
}
LOAD_FORMATS = ("auto", "safetensors", "dummy")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


class ModelError(ValueError):
    """A problem with the user's model folder; the message names the problem and the fix."""


def expected_experts(tokens: float, layers: int, num_experts: int, top_k: int) -> float:
    """Experts read, summed over `layers` MoE layers, by `tokens` tokens under uniform routing:
    each of a layer's experts escapes a token with probability 1 - top_k / num_experts."""
    if not layers or not num_experts:
        return 0.0
    return layers * num_experts * (1 - (1 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs from a Hugging Face decoder checkpoint, normalised across config.json
    versions."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: str  # "": none; "head": per head (Qwen3); "full": over each projection (OLMoE)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: torch.dtype
    sliding_window: int | None
    # Tensor parallelism (sharded()): the heads, KV heads and MLP width above are one rank's of
    # tp_size; each KV head is held by kv_head_replicas ranks (tp_size above the KV heads);
    # vocab_size stays the whole vocabulary.
    tp_size: int = 1
    kv_head_replicas: int = 1
    # Mixture of experts (num_experts 0: a dense model): each layer in moe_layers sends a token to
    # num_experts_per_tok of num_experts SwiGLU experts of width moe_intermediate_size (one rank's
    # part under tensor parallelism), weighted by the router's softmax over the chosen
    # (norm_topk_prob: renormalised to sum to 1); the other layers keep the dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    # FP8 linear weights (engine/quant.py): the checkpoint's, or --quantization fp8's (quantized)
    quantization: Fp8Scheme | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def expected_experts(self, tokens: float) -> float:
        """Experts `tokens` tokens read in all the MoE layers under uniform routing (0 for a dense
        model): expected_experts over this model's layers and experts."""
        return expected_experts(
            tokens, len(self.moe_layers), self.num_experts, self.num_experts_per_tok
        )

    def quantized(self, method: str | None, activations: str = "dynamic") -> ModelConfig:
        """The model with its linear weights in FP8 as method asks (None: as the checkpoint holds
        them), their activations as asked (ACTIVATIONS): 'fp8' quantizes a higher-precision
        checkpoint at load, and takes an FP8 one as it is; ModelError naming what is served for
        anything else."""
        if method is None and self.quantization is None:
            return self
        if method is not None and method not in QUANTIZATIONS:
            raise ModelError(
                f"--quantization {method}: ppd serves {', '.join(QUANTIZATIONS)} (FP8 weights, "
                "quantized at load or an FP8 checkpoint's); leave it out to serve the "
                "checkpoint's dtype"
            )
        if activations not in ACTIVATIONS:
            raise ModelError(
                f"FP8 activations {activations!r}: use one of {', '.join(ACTIVATIONS)}"
            )
        if self.is_moe:  # a checkpoint's FP8 experts were refused by from_folder
            raise ModelError(
                f"--quantization {method}: ppd holds a mixture of experts' weights in "
                f"{_name(self.dtype)} only (its experts' FP8 kernels are not built); leave "
                "--quantization out"
            )
        scheme = self.quantization or Fp8Scheme("online")
        return replace(self, quantization=replace(scheme, activations=activations))

    def sharded(self, n: int) -> ModelConfig:
        """The model as each of n tensor-parallel ranks holds it (Megatron's split: heads, KV heads,
        MLP width); ModelError naming the valid sizes when n does not split it."""
        assert self.tp_size == 1, "already sharded"
        if n == 1:
            return self
        if self.qk_norm == "full":
            raise ModelError(
                f"--tensor-parallel-size {n}: {self.architecture}'s q and k norms span every "
                "attention head, which ppd-serve does not split over ranks: serve it with "
                "--tensor-parallel-size 1"
            )
        valid = tensor_parallel_sizes(self)
        if n not in valid:
            experts = f", expert width {self.moe_intermediate_size}" if self.is_moe else ""
            raise ModelError(
                f"--tensor-parallel-size {n} does not split this model ({self.num_heads} attention "
                "heads, "
                f"{self.num_kv_heads} KV heads, MLP width {self.intermediate_size}{experts}): use "
                f"one of {', '.join(map(str, valid))}"
            )
        return replace(
            self,
            num_heads=self.num_heads // n,
            num_kv_heads=max(1, self.num_kv_heads // n),
            intermediate_size=self.intermediate_size // n,
            moe_intermediate_size=self.moe_intermediate_size // n,
            tp_size=n,
            kv_head_replicas=max(1, n // self.num_kv_heads),
        )

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and lm_head one rank holds: the vocabulary split in tp_size equal
        parts (the last rank's padded with zero rows)."""
        return -(-self.vocab_size // self.tp_size)

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        """Read path/config.json (and generation_config.json if present); ModelError if unsupported
        or malformed."""
        folder = Path(path)
        raw = _read_json(folder / "config.json", required=True)
        gen = _read_json(folder / "generation_config.json", required=False)
        arch = raw.get("model_type")
        if arch in UNSERVED_MOE:
            raise ModelError(
                f"model folder {folder} has model_type {arch!r}, a mixture-of-experts variant "
                f"ppd-serve does not serve ({UNSERVED_MOE[arch]}); mixtures of experts served: "
                f"{', '.join(MOE_ARCHS)}"
            )
        if arch not in SUPPORTED_ARCHS:
            raise ModelError(
                f"model folder {folder} has model_type {arch!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHS)}"
            )
        if raw.get("hidden_act", "silu") != "silu" or raw.get("mlp_bias", False):
            raise ModelError(
                f"model folder {folder}: only a bias-free SiLU MLP is supported (hidden_act silu, "
                "mlp_bias false)"
            )

        def need(key: str) -> Any:
            if raw.get(key) is None:
                raise ModelError(f"config.json in {folder} lacks {key!r} (is the file complete?)")
            return raw[key]

        num_heads = need("num_attention_heads")
        rope_theta, rope_scaling = _rope(raw, folder)
        max_pos = need("max_position_embeddings")
        # Qwen configs carry a sliding_window that is only in effect with use_sliding_window.
        windowed = arch in ("mistral", "mixtral") or (
            arch in ("qwen2", "qwen3", "qwen3_moe") and raw.get("use_sliding_window", False)
        )
        sliding_window = raw.get("sliding_window") if windowed else None
        if sliding_window is not None:
            # Windowed attention is not implemented: capping the context at the window makes every
            # key fall inside it, so full attention gives exactly the windowed result.
            max_pos = min(max_pos, sliding_window)
        num_layers = need("num_hidden_layers")
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or need("hidden_size") // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(raw.get("attention_bias", False)),
            qk_norm={"qwen3": "head", "qwen3_moe": "head", "olmoe": "full"}.get(arch, ""),
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), gen.get("eos_token_id")),
            bos_token_id=raw["bos_token_id"]
            if raw.get("bos_token_id") is not None
            else gen.get("bos_token_id"),
            dtype=_checkpoint_dtype(raw, folder),
            sliding_window=sliding_window,
            quantization=_quantization(raw, folder, arch),
            **_experts(arch, raw, num_layers, folder),
        )


def _experts(arch: str, raw: dict[str, Any], num_layers: int, folder: Path) -> dict[str, Any]:
    """The ModelConfig fields of a mixture of experts (none for a dense architecture), from
    config.json as transformers reads it for each: Qwen3-MoE's experts sit in every
    decoder_sparse_step-th layer outside mlp_only_layers, Mixtral's and OLMoE's in every layer
    (their intermediate_size is the experts' width); Mixtral always renormalises the chosen
    experts' weights."""
    if arch not in MOE_ARCHS:
        return {}
    shared = [
        k
        for k in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")
        if raw.get(k)
    ]
    if shared:
        raise ModelError(
            f"model folder {folder}: {arch} with shared experts ({shared[0]} "
            f"{raw[shared[0]]}) is not served: ppd-serve's mixtures of experts have none"
        )
    if arch == "olmoe" and raw.get("clip_qkv") is not None:
        raise ModelError(
            f"model folder {folder}: OLMoE with clip_qkv {raw['clip_qkv']} is not served (only "
            "clip_qkv null)"
        )
    # transformers 5 writes num_local_experts where hub configs have num_experts (an alias)
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if arch == "qwen3_moe":
        step = int(raw.get("decoder_sparse_step", 1))
        dense = set(raw.get("mlp_only_layers") or ())
        layers = tuple(
            i for i in range(num_layers) if i not in dense and step > 0 and (i + 1) % step == 0
        )
        if num_experts == 0:
            layers = ()
        width = raw.get("moe_intermediate_size")
    else:
        layers, width = tuple(range(num_layers)), raw.get("intermediate_size")
    top_k = int(raw.get("num_experts_per_tok") or 0)
    if num_experts and not (0 < top_k <= num_experts and width):
        raise ModelError(
            f"config.json in {folder}: {arch} needs num_experts_per_tok between 1 and its "
            f"{num_experts} experts and an expert width (got {top_k} and {width})"
        )
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(width or 0),
        "norm_topk_prob": True if arch == "mixtral" else bool(raw.get("norm_topk_prob", False)),
        "moe_layers": layers,
    }


def resolve_dtype(
    name: str, cfg: ModelConfig, device: str = "cpu", cpu_flags: Iterable[str] | None = None
) -> torch.dtype:
    """'auto' -> the checkpoint's dtype, except that a float32 checkpoint runs in bfloat16 on a GPU
    (as vLLM's auto does; pass --dtype float32 to keep it), and a bfloat16 or float16 one in
    float32 on a CPU without native bfloat16 (the log says why, once a process);
    'float32'|'bfloat16'|'float16' -> that; else ModelError. cpu_flags: the CPU's flags (by
    default this one's, engine/cpu_isa.py)."""
    on_cpu = not device.startswith("cuda")
    native = not on_cpu or has_native_bf16(cpu_flags)
    if name == "auto":
        if not on_cpu:
            return torch.bfloat16 if cfg.dtype == torch.float32 else cfg.dtype
        if cfg.dtype != torch.float32 and not native:
            _say(
                "dtype auto: this CPU has no native bfloat16 (neither "
                f"{' nor '.join(NATIVE_BF16_FLAGS)} among its "
                f"flags), where PyTorch's {_name(cfg.dtype)} matmuls run at a fraction of "
                "float32's speed: serving "
                f"the {_name(cfg.dtype)} checkpoint in float32 (twice its memory); pass --dtype "
                "bfloat16 to serve "
                "bfloat16, which our CPU kernels run at about float32's speed in less memory"
            )
            return torch.float32
        return cfg.dtype
    if name not in DTYPES:
        raise ModelError(f"unknown dtype {name!r}; use one of: auto, {', '.join(DTYPES)}")
    if name == "bfloat16" and not native:
        _say(
            "--dtype bfloat16 on a CPU without native bfloat16 (neither "
            f"{' nor '.join(NATIVE_BF16_FLAGS)} among its "
            "flags): linear layers of more than 8 rows multiply a float32 copy of each weight that "
            "each process "
            "makes (the weights take 0.75x float32's memory, not 0.5x), those of up to 8 rows and "
            "attention widen "
            "bfloat16 to float32 in our kernels; its speed against float32: "
            "docs/cpu-engine.md#the-dtype-on-the-cpu"
        )
    return DTYPES[name]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def _say(message: str) -> None:
    """Log a start-up decision once a process (resolve_dtype is asked by the server and by each
    worker)."""
    log.info("%s", message)


def tensor_parallel_sizes(cfg: ModelConfig, limit: int = 64) -> list[int]:
    """The tensor-parallel sizes up to limit that shard this model: they divide the attention heads
    and the MLP's width, and divide the KV heads or are a multiple of them (each KV head is then
    held by several ranks)."""
    h, kv, width = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    experts = cfg.moe_intermediate_size if cfg.is_moe else width
    return [
        n
        for n in range(1, limit + 1)
        if h % n == 0 and width % n == 0 and experts % n == 0 and (kv % n == 0 or n % kv == 0)
    ]


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the checkpoint tensors the model needs, in Hugging Face naming."""
    h, d, vocab = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for name, rows in (
            ("q", cfg.num_heads * d),
            ("k", cfg.num_kv_heads * d),
            ("v", cfg.num_kv_heads * d),
        ):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, h)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * d)
        if cfg.qk_norm == "full":
            shapes[p + "self_attn.q_norm.weight"] = (cfg.num_heads * d,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.num_kv_heads * d,)
        elif cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if i in cfg.moe_layers:
            router, experts = expert_names(cfg, i)
            shapes[router] = (cfg.num_experts, h)
            for gate, up, down in experts:
                shapes[gate] = shapes[up] = (cfg.moe_intermediate_size, h)
                shapes[down] = (h, cfg.moe_intermediate_size)
            continue
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def expert_names(cfg: ModelConfig, layer: int) -> tuple[str, list[tuple[str, str, str]]]:
    """The checkpoint's names of a mixture-of-experts layer's tensors: its router's, and each
    expert's (gate, up, down) projections (Mixtral's w1, w3, w2)."""
    if cfg.architecture == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe."
        parts = ("w1", "w3", "w2")
    else:
        p = f"model.layers.{layer}.mlp."
        parts = ("gate_proj", "up_proj", "down_proj")
    experts = [
        tuple(f"{p}experts.{e}.{part}.weight" for part in parts) for e in range(cfg.num_experts)
    ]
    return p + "gate.weight", experts  # type: ignore[return-value]


def safetensors_index(folder: str | Path) -> dict[str, Path]:
    """Map each tensor name in folder/*.safetensors to its file, reading only the headers."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelError(
            f"no *.safetensors files in {folder}; convert the checkpoint to safetensors, "
            "or use --load-format dummy for random weights"
        )
    index: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            index.update((name, file) for name in f.keys())  # noqa: SIM118 (safe_open is not a dict)
    return index


def missing_tensors_error(folder: str | Path, missing: list[str]) -> ModelError:
    """The error for a checkpoint that lacks tensors the config requires."""
    shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
    return ModelError(f"missing tensors in {folder}: {shown} (is the checkpoint complete?)")


def check_model_folder(path: str | Path, load_format: str = "auto") -> ModelConfig:
    """Check everything possible before any process starts (folder, config, tensor names and shapes
    from the safetensors headers); returns the config or raises ModelError with a clear message."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelError(
            f"model folder {folder} does not exist (pass --model a local Hugging Face model "
            "folder, a "
            "GGUF file, or smollm2)"
        )
    cfg = ModelConfig.from_folder(folder)
    if load_format not in LOAD_FORMATS:
        raise ModelError(
            f"unknown load format {load_format!r}; use one of: {', '.join(LOAD_FORMATS)}"
        )
    if load_format == "dummy":
        return cfg
    index = safetensors_index(folder)
    expected = weight_shapes(cfg)
    missing = [name for name in expected if name not in index]
    if missing:
        raise missing_tensors_error(folder, missing)
    for file in sorted({index[name] for name in expected}):
        with safe_open(file, framework="pt") as f:
            for name in (n for n in expected if index[n] == file):
                found = tuple(f.get_slice(name).get_shape())
                if found != expected[name]:
                    raise ModelError(
                        f"tensor {name} in {file} has shape {found} but config.json implies "
                        f"{expected[name]} "
                        "(config.json does not match the weights)"
                    )
    return cfg


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelError(
                f"no {path.name} in {path.parent} (is this a Hugging Face model folder?)"
            )
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {path}: {e} (fix or re-download the file)") from e
    if not isinstance(data, dict):
        raise ModelError(f"{path} is not a JSON object (fix or re-download the file)")
    return data


def _rope(raw: dict[str, Any], folder: Path) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, llama3 scaling or None) from either transformers 5's `rope_parameters`
    or the older top-level `rope_theta` + `rope_scaling` that hub checkpoints carry."""
    params = raw.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ModelError(f"model folder {folder}: per-layer-type rope_parameters are not supported")
    scaling = dict(params) if params else dict(raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelError(
            f"model folder {folder} uses RoPE scaling {rope_type!r}; supported: default, llama3"
        )
    absent = [k for k in LLAMA3_ROPE_KEYS[:3] if k not in scaling]
    if absent:
        raise ModelError(f"llama3 RoPE scaling in {folder}/config.json lacks {', '.join(absent)}")
    # Like transformers, fall back to the configured context when the pretraining length is not
    # given.
    scaling.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    return theta, {"rope_type": "llama3", **{k: scaling[k] for k in LLAMA3_ROPE_KEYS}}


def _eos_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    ids: list[int] = []
    for v in values:
        for i in [v] if isinstance(v, int) else (v or []):
            if i not in ids:
                ids.append(i)
    return tuple(ids)


def _quantization(raw: dict[str, Any], folder: Path, arch: str) -> Fp8Scheme | None:
    """The checkpoint's FP8 scheme (quantization_config), or ModelError naming what is served."""
    try:
        scheme = scheme_from_config(raw, folder)
    except QuantError as e:
        raise ModelError(str(e)) from e
    if scheme is not None and arch in MOE_ARCHS:
        raise ModelError(
            f"model folder {folder} holds a mixture of experts in FP8; ppd serves FP8 weights of "
            "dense models (its experts' FP8 kernels are not built): serve the bfloat16 checkpoint"
        )
    return scheme


def _checkpoint_dtype(raw: dict[str, Any], folder: Path) -> torch.dtype:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ModelError(
            f"model folder {folder} stores dtype {name!r}; supported: {', '.join(DTYPES)}"
        )
    return DTYPES[name]
