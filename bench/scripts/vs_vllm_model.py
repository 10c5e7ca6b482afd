"""Write the comparison's model: bench/models/llama-1b-cpu's configuration with random bf16 weights
(seed 0) and the demo model's byte-level tokenizer and chat template. Usage: python
bench/scripts/vs_vllm_model.py OUT_FOLDER"""

import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.demo import demo_model_path

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
demo = demo_model_path()
cfg = json.loads(
    (Path(__file__).resolve().parents[1] / "models/llama-1b-cpu/config.json").read_text()
)
cfg.pop("architectures", None)
cfg.update(
    {
        k: json.loads((demo / "config.json").read_text())[k]
        for k in ("bos_token_id", "eos_token_id", "vocab_size")
    }
)
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16).save_pretrained(out)
for f in demo.iterdir():
    if "token" in f.name or f.name in ("chat_template.jinja", "generation_config.json"):
        shutil.copy(f, out / f.name)
print(sorted(p.name for p in out.iterdir()))
