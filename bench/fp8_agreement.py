"""What FP8 costs in accuracy on a real model: greedy agreement with bfloat16 over fixed chat
prompts.

    python -m bench.fp8_agreement --out bench/results/cpu-2core/fp8-agreement

SmolLM2-135M-Instruct (`--model smollm2`, its float32 weights from the GGUF the server reads), in
bfloat16 as the baseline, and each FP8 variant in bfloat16 around it: weight-only FP8 (W8A16),
FP8 weights with activations quantized per token (W8A8, what --quantization fp8 serves), the FP8 KV
cache alone, and both. For each prompt (the 20 chat questions of tests/server/test_real_model.py),
64 greedy tokens in one process through the torch backend (what the CPU serves FP8 with); a
variant agrees with the baseline on a prompt when all 64 ids are equal, and the tokens before the
first difference are counted. Prints and writes a JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from engine.gguf import model_folder, smollm2_gguf
from engine.loader import kv_scales, load_model
from engine.model import Model, kv_pool_shape
from engine.model_runner import ModelRunner, StepInput
from engine.quant import FP8, dense_copies

QUESTIONS = [  # tests/server/test_real_model.py's too
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that adds two numbers.",
    "Name three colours of the rainbow.",
    "Why is the sky blue?",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "What is photosynthesis?",
    "Suggest a name for a pet cat.",
    "What is the boiling point of water in Celsius?",
    "Write a haiku about the sea.",
    "What does a CPU do in a computer?",
    "List two benefits of regular exercise.",
    "What is the largest planet?",
    "Explain what a noun is.",
    "How do you make a cup of tea?",
    "What is the opposite of cold?",
    "Tell me a fun fact about octopuses.",
]
# name -> (--quantization, --fp8-activations, --kv-cache-dtype), in bfloat16 but float32's row:
# the same weights in float32, the measure's noise floor (bfloat16's own rounding parts greedy
# texts at near-ties, tests/server/test_real_model.py)
VARIANTS = {
    "bf16": (None, "dynamic", "auto"),
    "fp8 W8A8": ("fp8", "dynamic", "auto"),
    "fp8 KV": (None, "dynamic", "fp8"),
    "fp8 W8A8 + fp8 KV": ("fp8", "dynamic", "fp8"),
    "fp8 W8A16": ("fp8", "none", "auto"),
    "float32": (None, "dynamic", "auto"),
}
BLOCK = 16


def greedy(model: Model, kv_dtype: torch.dtype, prompt: list[int], n: int) -> list[int]:
    """n greedy ids after prompt, one sequence in its own pool."""
    blocks = -(-(len(prompt) + n) // BLOCK)
    pool = torch.zeros(kv_pool_shape(model.cfg, blocks, BLOCK), dtype=kv_dtype)
    runner = ModelRunner(model, pool, BLOCK, "torch")
    table, tokens, cached = list(range(blocks)), list(prompt), 0
    while len(tokens) < len(prompt) + n:
        logits = runner.forward([StepInput(tokens[cached:], cached, table)])
        cached = len(tokens)
        tokens.append(int(logits[0].argmax()))
    return tokens[len(prompt) :]


def slug(name: str) -> str:
    return name.replace(" + ", "-").replace(" ", "-").lower()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--variants", default=None, help=f"comma-separated, of: {', '.join(VARIANTS)} (default all)"
    )
    args = parser.parse_args()
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    gguf = smollm2_gguf()
    folder = model_folder(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for q in QUESTIONS
    ]
    # Each variant's ids go to --out as it ends (ids-<variant>.json), and a rerun takes them from
    # there: several processes may share the variants (--variants).
    names = args.variants.split(",") if args.variants else list(VARIANTS)
    for name in names:
        quantization, activations, kv = VARIANTS[name]
        done = args.out / f"ids-{slug(name)}.json" if args.out else None
        if done is not None and done.exists():
            continue
        dtype = "float32" if name == "float32" else "bfloat16"
        model, _ = load_model(folder, dtype, quantization=quantization, fp8_activations=activations)
        kv_dtype = model.dtype if kv == "auto" else FP8
        if kv_dtype == FP8:
            model.set_kv_scales(kv_scales(model, folder, "auto"))
        with dense_copies():  # each e4m3 weight converted once, not at every step (quant.py)
            ids = [greedy(model, kv_dtype, p, args.tokens) for p in prompts]
        print(f"{name}: done", flush=True)
        if done is not None:
            done.parent.mkdir(parents=True, exist_ok=True)
            done.write_text(json.dumps(ids))
    if args.out is None or not all((args.out / f"ids-{slug(n)}.json").exists() for n in VARIANTS):
        return
    outputs = {
        name: json.loads((args.out / f"ids-{slug(name)}.json").read_text()) for name in VARIANTS
    }
    base = outputs["bf16"]
    rows = []
    for name, outs in outputs.items():
        if name == "bf16":
            continue
        agreed = [
            next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r))
            for o, r in zip(outs, base)
        ]
        rows.append(
            {
                "variant": name,
                "prompts_equal": sum(a == args.tokens for a in agreed),
                "prompts": len(prompts),
                "median_tokens_before_difference": statistics.median(agreed),
                "tokens_before_difference": agreed,
            }
        )
    table = [
        f"| variant | prompts with all {args.tokens} ids equal to bf16 | first id equal | median "
        "ids before the first difference |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        first = sum(a > 0 for a in r["tokens_before_difference"])
        table.append(
            f"| {r['variant']} | {r['prompts_equal']} of {r['prompts']} | {first} of "
            f"{r['prompts']} | {r['median_tokens_before_difference']:g} |"
        )
    print("\n".join(table))
    if args.out:
        (args.out / "agreement.json").write_text(
            json.dumps({"tokens": args.tokens, "rows": rows}, indent=1)
        )
        (args.out / "agreement.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
