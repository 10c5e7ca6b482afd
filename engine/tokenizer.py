"""Loading a model folder's tokenizer as transformers' AutoTokenizer does, seconds sooner where
the folder names transformers' generic fast tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# tokenizer_config.json's names of transformers' generic fast tokenizer (5.x renamed it)
GENERIC_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


def generic_tokenizer(path: str | Path) -> Any | None:
    """The folder's tokenizer, where its tokenizer_config.json names transformers' generic fast
    tokenizer (everything in its tokenizer.json), loaded as that class; None otherwise.
    AutoTokenizer makes the same object after reading the model's config through AutoConfig, which
    imports the architecture's modeling code: 2-3 s of every start on 2 cores."""
    from transformers import PreTrainedTokenizerFast

    folder = Path(path)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    named = isinstance(config, dict) and config.get("tokenizer_class") in GENERIC_TOKENIZERS
    if not named or not (folder / "tokenizer.json").is_file():
        return None
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def auto_tokenizer(path: str | Path) -> Any:
    """AutoTokenizer.from_pretrained(path), through generic_tokenizer where it serves."""
    from transformers import AutoTokenizer

    return generic_tokenizer(path) or AutoTokenizer.from_pretrained(str(path))
