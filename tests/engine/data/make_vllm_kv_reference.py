"""Write vllm_kv_reference.json: block hashes and an encoded event batch computed by vLLM's own
code.

The oracle for tests/engine/test_kv_events.py. vLLM is not installable on the
test machines (it needs CUDA torch), so this runs once, by hand, against the
source files of a vLLM wheel: it lifts the hash and event definitions out of
them with `ast` and runs them on fixed inputs. To refresh (a new vLLM version):

    pip download vllm==0.33.0 --no-deps -d /tmp/vllm && cd /tmp/vllm && unzip -q vllm-*.whl 'vllm/*'
    pip install cbor2
    python tests/engine/data/make_vllm_kv_reference.py /tmp/vllm \
      > tests/engine/data/vllm_kv_reference.json
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any, NewType

import cbor2
import msgspec


def lift(path: Path, names: set[str], namespace: dict[str, Any]) -> None:
    """Run the top-level definitions `names` of a source file in namespace."""
    tree = ast.parse(path.read_text())
    keep = []
    for node in tree.body:
        name = getattr(node, "name", None)
        if name is None and isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            name = getattr(target, "id", None)
        if name in names:
            keep.append(node)
    missing = names - {
        getattr(n, "name", None)
        or getattr(getattr(n, "target", None), "id", None)
        or getattr(n.targets[0], "id", None)
        for n in keep
    }
    assert not missing, f"{path} has no {missing}"
    exec(compile(ast.Module(keep, []), str(path), "exec"), namespace)


def main(root: Path) -> None:
    ns: dict[str, Any] = {
        "hashlib": hashlib,
        "pickle": pickle,
        "cbor2": cbor2,
        "Any": Any,
        "os": os,
        "msgspec": msgspec,
        "NewType": NewType,
        "Callable": object,
        "Sequence": object,
        "logger": None,
    }
    lift(root / "vllm/utils/hashing.py", {"sha256", "sha256_cbor"}, ns)
    ns.update(
        xxhash=object(),
        xxhash_cbor=object(),
        BlockHash=bytes,
        ExternalBlockHash=Any,
        envs=type("envs", (), {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": True}),
    )
    lift(
        root / "vllm/v1/core/kv_cache_utils.py",
        {
            "DEFAULT_NONE_HASH_SEED",
            "_NON_CRYPTO_HASH_FUNCTIONS",
            "_NONE_HASH_SEED",
            "resolve_none_hash_seed",
            "init_none_hash",
            "hash_block_tokens",
            "maybe_convert_block_hash",
        },
        ns,
    )
    lift(
        root / "vllm/distributed/kv_events.py",
        {
            "EventBatch",
            "KVCacheEvent",
            "MEDIUM_GPU",
            "BlockStored",
            "BlockRemoved",
            "AllBlocksCleared",
            "KVEventBatch",
        },
        ns,
    )

    tokens = list(range(1000, 1000 + 40))
    version: dict[str, Any] = {}
    exec((root / "vllm/_version.py").read_text(), version)
    out: dict[str, Any] = {"vllm": version["__version__"], "token_ids": tokens, "chains": []}
    for algo in ("sha256", "sha256_cbor"):
        for seed in (None, "0"):
            if seed is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = seed
            fn = ns[algo]
            ns["init_none_hash"](fn)
            for block_size in (4, 16):
                hashes, parent = [], None
                for start in range(0, len(tokens) - block_size + 1, block_size):
                    parent = ns["hash_block_tokens"](
                        fn, parent, tokens[start : start + block_size], None
                    )
                    hashes.append(parent)
                out["chains"].append(
                    {
                        "algo": algo,
                        "seed": seed,
                        "block_size": block_size,
                        "hashes": [h.hex() for h in hashes],
                        "external": [ns["maybe_convert_block_hash"](h) for h in hashes],
                    }
                )
    batch = ns["KVEventBatch"](
        ts=1700000000.5,
        data_parallel_rank=1,
        events=[
            ns["BlockStored"](
                block_hashes=[11, 12],
                parent_block_hash=None,
                token_ids=tokens[:8],
                block_size=4,
                lora_id=None,
                medium=ns["MEDIUM_GPU"],
                lora_name=None,
                group_idx=0,
            ),
            ns["BlockStored"](
                block_hashes=[13],
                parent_block_hash=12,
                token_ids=tokens[8:12],
                block_size=4,
                lora_id=None,
                medium=ns["MEDIUM_GPU"],
                lora_name=None,
                group_idx=0,
            ),
            ns["BlockRemoved"](block_hashes=[13, 12], medium=ns["MEDIUM_GPU"], group_idx=0),
            ns["AllBlocksCleared"](),
        ],
    )
    out["batch_msgpack"] = msgspec.msgpack.encode(batch).hex()
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
