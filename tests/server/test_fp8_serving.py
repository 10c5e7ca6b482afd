"""FP8 through the whole server, both workers and both routes: weight-only FP8 gives transformers'
greedy ids on the weights it stands for; FP8 weights with quantized activations and an FP8 KV pool
give what the same model gives in one process, so the two workers write and read one FP8 pool
alike (a turn-2 append on the decode route reads KV the prefill worker wrote, and the other way)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.demo import write_byte_tokenizer
from engine.loader import load_model
from tests.engine.test_fp8 import fp8_kv_engine
from tests.engine.test_model_vs_hf import Seq
from tests.server.test_routes_vs_hf import NEW_TOKENS, complete, ids
from tests.server_process import ServerProcess
from tests.tiny_models import (
    FP8_LAYOUTS,
    hf_greedy,
    write_dequantized_model,
    write_fp8_checkpoint,
    write_tiny_model,
)


def serve(start_server, folder: Path, *flags: str) -> ServerProcess:
    write_byte_tokenizer(folder)
    return start_server(
        "--model",
        str(folder),
        "--served-model-name",
        "tiny",
        "--policy",
        "ppd",
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "16",
        *flags,
    )


def turns_on_both_routes(server: ServerProcess, greedy) -> None:
    """Turn 1, then a turn-2 append on each route; each answer's ids equal greedy(prompt)."""
    rng = random.Random(0)
    for append, route in ((ids(rng, 10), "decode"), (ids(rng, 54), "prefill")):
        prompt = ids(rng, 45)
        out1, _, _ = complete(server, prompt)
        assert out1 == greedy(prompt)
        turn2 = prompt + out1 + append
        out2, served_route, cached = complete(server, turn2, route=route)
        assert served_route == route and cached > 0
        assert out2 == greedy(turn2)


# a server each (15-30 s on 2 cores); weight-only FP8 is checked against transformers per
# architecture and checkpoint layout in tests/engine/test_fp8.py, in the default suite
@pytest.mark.slow
@pytest.mark.parametrize("source", ["online", *FP8_LAYOUTS])
def test_weight_only_fp8_serves_transformers_greedy_ids(
    source: str, start_server, tmp_path: Path
) -> None:
    """--quantization fp8 on a float32 checkpoint, and FP8 checkpoint files in each layout served as
    they are, weight-only: transformers' greedy ids on the weights they stand for."""
    folder = write_tiny_model(tmp_path / "llama", "llama")
    if source == "online":
        plain = write_dequantized_model(folder, tmp_path / "dequantized")
        flags = ("--quantization", "fp8")
    else:
        folder, plain = write_fp8_checkpoint(folder, tmp_path / "fp8", source)
        flags = ()
    server = serve(start_server, folder, *flags, "--fp8-activations", "none")
    turns_on_both_routes(server, lambda prompt: hf_greedy(plain, prompt, NEW_TOKENS))


def test_fp8_weights_and_kv_serve_what_one_process_computes(start_server, tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "qwen3", "qwen3")
    server = serve(start_server, folder, "--quantization", "fp8", "--kv-cache-dtype", "fp8")
    model, _ = load_model(folder, quantization="fp8")

    def greedy(prompt: list[int]) -> list[int]:
        return fp8_kv_engine(model, folder).generate(Seq(list(prompt)), NEW_TOKENS)

    turns_on_both_routes(server, greedy)
