"""The built-in demo model: a tiny Llama with random weights and a byte-level tokenizer.

`ppd serve` with no model serves it, so the whole server runs (and is tested) on
any machine without downloads. The folder looks like a Hugging Face checkpoint,
so the same loading code serves it and transformers can act as the reference.
This module runs at server start: it uses torch and safetensors only, never
transformers' model classes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from profiles import cache_dir as ppd_cache_dir

DEMO_MODEL = "demo"
DEMO_FOLDER = "demo-v2"  # bump the suffix whenever the contents change: old caches are then ignored

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
END_TOKEN = "<|end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
NUM_BYTES = 256

# Roles are limited to those the tokenizer has tokens for, and tool; "developer" is OpenAI's newer
# name for "system". Text parts are joined with "\n", as vLLM does. Tools are written as Qwen2.5
# writes them (a system turn listing them, calls in <tool_call> blocks, results as <tool_response>
# blocks in a user turn), and an assistant's calls exactly as the model is told to write them, so
# turn 2's prompt extends turn 1's and its cache is reused. Without tools, tool calls or tool
# messages a conversation renders as <|role|>\n + text + <|end|>\n per message, then <|assistant|>\n
# when the generation prompt is asked for.
CHAT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content -%}
{{- content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('\n') -}}
{%- endif -%}
{%- endmacro -%}
{%- set system_in_tools = tools and messages and messages[0]['role'] in ['system', 'developer'] -%}
{%- if tools -%}
{{- '<|system|>\n' -}}
{%- if system_in_tools -%}
{{- text(messages[0]['content']) + '\n\n' -}}
{%- endif -%}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
{%- for tool in tools -%}
{{- '\n' + tool | tojson -}}
{%- endfor -%}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and ' -}}
{{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
{{- '{"name": <function-name>, "arguments": <args-json-object>}' -}}
{{- '\n</tool_call><|end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- set role = 'system' if message['role'] == 'developer' else message['role'] -%}
{%- if role not in ['system', 'user', 'assistant', 'tool'] -%}
{{- raise_exception('The demo model supports the roles system, user, assistant and tool, not '
                    + role) -}}
{%- endif -%}
{%- if loop.first and system_in_tools -%}
{#- written with the tools above -#}
{%- elif role == 'tool' -%}
{%- if loop.first or loop.previtem['role'] != 'tool' -%}
{{- '<|user|>' -}}
{%- endif -%}
{{- '\n<tool_response>\n' + text(message['content']) + '\n</tool_response>' -}}
{%- if loop.last or loop.nextitem['role'] != 'tool' -%}
{{- '<|end|>\n' -}}
{%- endif -%}
{%- elif role == 'assistant' and message['tool_calls'] -%}
{{- '<|assistant|>' -}}
{%- set content = text(message['content']) -%}
{%- if content -%}
{{- '\n' + content -}}
{%- endif -%}
{%- for call in message['tool_calls'] -%}
{%- set call = call['function'] if call['function'] is defined else call -%}
{%- set arguments = call['arguments'] -%}
{%- if arguments is not string -%}
{%- set arguments = arguments | tojson -%}
{%- endif -%}
{{- '\n<tool_call>\n{"name": "' + call['name'] + '", "arguments": ' -}}
{{- arguments + '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|end|>\n' -}}
{%- else -%}
{{- '<|' + role + '|>\n' + text(message['content']) + '<|end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|assistant|>\n' -}}
{%- endif -%}
"""

CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 768,
    "vocab_size": 320,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "float32",  # read by transformers < 4.56
    "dtype": "float32",  # read by newer transformers
}
SEED = 0
# Chosen so that the output varies (it does not settle into repeating one token)
# and greedy choices win by clear margins (median top-1/top-2 logit gap about 1),
# not by float noise: the server's greedy output must match transformers'.
MATRIX_STD = 0.05
EMBEDDING_STD = 1.0
LM_HEAD_STD = 0.25


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of ByteLevel tokenizers."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(NUM_BYTES):
        if b not in mapping:
            mapping[b] = chr(NUM_BYTES + shift)
            shift += 1
    return mapping


def _special_tokens(vocab_size: int) -> list[str]:
    named = [BOS_TOKEN, END_OF_TEXT_TOKEN, *ROLE_TOKENS, END_TOKEN]
    if vocab_size < NUM_BYTES + len(named):
        raise ValueError(f"vocab_size must be at least {NUM_BYTES + len(named)}, got {vocab_size}")
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - NUM_BYTES - len(named))]
    return named + reserved


def write_byte_tokenizer(folder: Path, vocab_size: int = 320) -> None:
    """Write a byte-level tokenizer with exactly `vocab_size` tokens into `folder`.

    Token id b (< 256) is byte b; every text round-trips and tokenize(a + b) ==
    tokenize(a) + tokenize(b). Ids from 256 up are special tokens (chat markers,
    then reserved ones). Loadable offline with AutoTokenizer.from_pretrained.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    byte_chars = _bytes_to_unicode()
    # No merges: one token per byte, which is what makes tokenization stable
    # under concatenation (multi-turn prefix caching relies on it).
    vocab = {byte_chars[b]: b for b in range(NUM_BYTES)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = _special_tokens(vocab_size)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    assert tokenizer.get_vocab_size() == vocab_size, "special tokens must get ids 256.. in order"
    tokenizer.save(str(folder / "tokenizer.json"))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": END_TOKEN,
        "pad_token": END_OF_TEXT_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        # The default clean-up rewrites " ." as "." and would break round-trips.
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONFIG["max_position_embeddings"],
        # Older transformers read the template here, newer ones from chat_template.jinja.
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _random_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Deterministic random Llama weights, named as transformers' LlamaForCausalLM names them."""
    generator = torch.Generator().manual_seed(SEED)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv_dim = head_dim * config["num_key_value_heads"]

    def normal(rows: int, cols: int, std: float = MATRIX_STD) -> torch.Tensor:
        return torch.empty(rows, cols).normal_(0.0, std, generator=generator)

    weights = {"model.embed_tokens.weight": normal(vocab, hidden, EMBEDDING_STD)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        weights[f"{prefix}.self_attn.q_proj.weight"] = normal(hidden, hidden)
        weights[f"{prefix}.self_attn.k_proj.weight"] = normal(kv_dim, hidden)
        weights[f"{prefix}.self_attn.v_proj.weight"] = normal(kv_dim, hidden)
        weights[f"{prefix}.self_attn.o_proj.weight"] = normal(hidden, hidden)
        weights[f"{prefix}.mlp.gate_proj.weight"] = normal(inter, hidden)
        weights[f"{prefix}.mlp.up_proj.weight"] = normal(inter, hidden)
        weights[f"{prefix}.mlp.down_proj.weight"] = normal(hidden, inter)
        weights[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden)
        weights[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = normal(vocab, hidden, LM_HEAD_STD)
    return weights


def _write_demo_model(folder: Path) -> None:
    write_byte_tokenizer(folder, CONFIG["vocab_size"])
    token_ids = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in token_ids}
    bos_id, eos_ids = ids[BOS_TOKEN], [ids[END_TOKEN], ids[END_OF_TEXT_TOKEN]]
    config = {
        **CONFIG,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        "pad_token_id": ids[END_OF_TEXT_TOKEN],
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation_config = {
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        "pad_token_id": ids[END_OF_TEXT_TOKEN],
    }
    (folder / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    save_file(_random_weights(config), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "README.md").write_text(
        "# ppd-serve demo model\n\n"
        "A 4-layer Llama with RANDOM weights (seed 0) and a byte-level tokenizer, built by\n"
        "engine/demo.py so the server runs without downloads. Its output is gibberish;\n"
        "it exists to exercise the serving path, not to answer questions.\n"
    )


def demo_model_path(cache_dir: Path | None = None) -> Path:
    """Return the demo model folder, building it on first use.

    It lives in `cache_dir`, else $PPD_CACHE_DIR, else ~/.cache/ppd-serve. The
    build is atomic (temp folder + rename), so concurrent first starts are safe.
    """
    if cache_dir is None:
        cache_dir = ppd_cache_dir()
    folder = Path(cache_dir) / DEMO_FOLDER
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_FOLDER}-", dir=folder.parent))
    try:
        _write_demo_model(tmp)
        os.rename(tmp, folder)
    except OSError:
        # Another process renamed its build into place first: use theirs.
        if not folder.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
