"""Incremental detokenization: streamed text equals the full decode, stop strings are cut out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.demo import write_byte_tokenizer
from server.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer

TEXTS = [
    "Hello, world! This is a test.",
    "héllo wörld — ñ and ç",
    "日本語のテキスト，中文也可以。",
    "emoji 🙂👍🏽 and a family 👨‍👩‍👧 in one line",
    "mixed: a 🙂 b 世 c\n\ttabs  and  spaces ",
]


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("byte-tokenizer")
    write_byte_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="module")
def bpe_tokenizer() -> Any:
    """A byte-level BPE whose tokens span several characters, and split some multi-byte ones."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
    )
    tokenizer.train_from_iterator(TEXTS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="module")
def word_tokenizer() -> Any:
    """Whole-word tokens joined by spaces on decode: the text of a token depends on its
    neighbours."""
    words = ["[UNK]", "Hello", "world", "STOP", "go", "!"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False)


def stream(
    tokenizer: Any, ids: Sequence[int], stop: Sequence[str] = (), chunk: int = 1, **kwargs: Any
) -> tuple[list[str], str, IncrementalDetokenizer]:
    """Feed ids `chunk` at a time; return the pieces add() gave, what flush() gave, and the
    detokenizer."""
    detok = IncrementalDetokenizer(tokenizer, stop=stop, **kwargs)
    pieces = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return pieces, detok.flush(), detok


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
@pytest.mark.parametrize("name", ["byte_tokenizer", "bpe_tokenizer"])
def test_pieces_concatenate_to_the_full_decode(
    name: str, chunk: int, request: pytest.FixtureRequest
) -> None:
    tokenizer = request.getfixturevalue(name)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces, rest, detok = stream(tokenizer, ids, chunk=chunk)
        assert "".join(pieces) + rest == tokenizer.decode(ids) == text
        assert detok.text == text and not detok.stopped


class _PythonOnlyTokenizer:
    """A tokenizer with transformers' decode but no Rust backend (a slow, Python tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = tokenizer.decode
        self.all_special_ids = tokenizer.all_special_ids


def test_a_tokenizer_without_a_rust_backend_gives_the_same_text(bpe_tokenizer: Any) -> None:
    slow = _PythonOnlyTokenizer(bpe_tokenizer)
    assert not hasattr(slow, "backend_tokenizer")
    for text in TEXTS:
        ids = bpe_tokenizer.encode(text, add_special_tokens=False)
        pieces, rest, _ = stream(slow, ids, chunk=2)
        assert "".join(pieces) + rest == text


def test_bpe_tokens_really_span_characters(bpe_tokenizer: Any) -> None:
    ids = bpe_tokenizer.encode(TEXTS[0], add_special_tokens=False)
    assert len(ids) < len(TEXTS[0]) / 2


@pytest.mark.parametrize("name", ["byte_tokenizer", "bpe_tokenizer"])
def test_multi_byte_characters_are_never_sent_broken(
    name: str, request: pytest.FixtureRequest
) -> None:
    tokenizer = request.getfixturevalue(name)
    for text in TEXTS[1:]:
        pieces, _, _ = stream(tokenizer, tokenizer.encode(text, add_special_tokens=False))
        for piece in pieces:
            assert "\ufffd" not in piece
            assert piece == piece.encode("utf-8").decode("utf-8")
        # Some tokens ended inside a character, so some calls had to hold text back.
        assert "" in pieces or name == "bpe_tokenizer"


def test_text_is_sent_as_soon_as_it_is_complete(byte_tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer)
    smile = list("🙂".encode())
    assert detok.add([ord("a")]) == "a"
    assert [detok.add([b]) for b in smile] == ["", "", "", "🙂"]


def test_a_chunk_ending_inside_a_character_releases_what_precedes_it(byte_tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer)
    smile = list("🙂".encode())
    assert detok.add([ord("a"), ord("b"), *smile[:2]]) == "ab"
    assert detok.add(smile[2:]) == "🙂"


def test_word_tokenizer_keeps_the_spaces_between_tokens(word_tokenizer: Any) -> None:
    ids = word_tokenizer.convert_tokens_to_ids(["Hello", "world", "!", "go"])
    pieces, rest, _ = stream(word_tokenizer, ids)
    assert "".join(pieces) + rest == word_tokenizer.decode(ids) == "Hello world ! go"


def test_special_tokens_are_skipped_or_kept(byte_tokenizer: Any) -> None:
    end, reserved = byte_tokenizer.convert_tokens_to_ids(["<|end|>", "<|reserved_3|>"])
    ids = [*b"ab", end, *"é".encode(), reserved, *b"c"]
    pieces, rest, _ = stream(byte_tokenizer, ids)
    assert "".join(pieces) + rest == "abéc"
    pieces, rest, _ = stream(byte_tokenizer, ids, skip_special_tokens=False)
    assert "".join(pieces) + rest == "ab<|end|>é<|reserved_3|>c"


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_across_tokens_stops_and_is_excluded(byte_tokenizer: Any, chunk: int) -> None:
    ids = byte_tokenizer.encode("Hello there STOP and more text after", add_special_tokens=False)
    pieces, rest, detok = stream(byte_tokenizer, ids, stop=["STOP"], chunk=chunk)
    assert detok.stopped and detok.stop_string == "STOP"
    assert "".join(pieces) == detok.text == "Hello there "  # fully delivered before flush
    assert rest == ""
    assert detok.add(byte_tokenizer.encode("more", add_special_tokens=False)) == ""


def test_stop_string_inside_a_multi_character_token(bpe_tokenizer: Any) -> None:
    text = TEXTS[0]
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    pieces, rest, detok = stream(bpe_tokenizer, ids, stop=["lo, wo"])
    assert detok.stopped and "".join(pieces) + rest == "Hel"


def test_stop_string_made_of_multi_byte_characters(byte_tokenizer: Any) -> None:
    ids = byte_tokenizer.encode("日本語のテキスト", add_special_tokens=False)
    pieces, rest, detok = stream(byte_tokenizer, ids, stop=["のテ"])
    assert detok.stopped and "".join(pieces) + rest == "日本語"


def test_earliest_stop_string_wins(byte_tokenizer: Any) -> None:
    ids = byte_tokenizer.encode("hello world", add_special_tokens=False)
    _, _, detok = stream(byte_tokenizer, ids, stop=["world", "lo w", "o"])
    assert detok.text == "hell" and detok.stop_string == "o"
    _, _, detok = stream(byte_tokenizer, ids, stop=["world", "lo w"])
    assert detok.text == "hel" and detok.stop_string == "lo w"


def test_only_a_possible_stop_prefix_is_held_back(byte_tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer, stop=["STOP"])
    sent = "".join(detok.add([b]) for b in b"abc ST")
    assert sent == "abc "  # "ST" could begin "STOP"
    assert detok.add([ord("A")]) == "STA"  # ... and "STA" cannot
    assert detok.add([ord("S")]) == ""
    assert detok.flush() == "S"
    assert detok.text == "abc STAS" and not detok.stopped


def test_flush_releases_the_held_back_tail(byte_tokenizer: Any) -> None:
    ids = byte_tokenizer.encode("the end is STO", add_special_tokens=False)
    pieces, rest, detok = stream(byte_tokenizer, ids, stop=["STOP"])
    assert "".join(pieces) == "the end is " and rest == "STO"
    assert detok.text == "the end is STO" and not detok.stopped


def test_flush_renders_an_unfinished_character_like_decode(byte_tokenizer: Any) -> None:
    ids = [ord("a"), *"世".encode()[:2]]
    pieces, rest, _ = stream(byte_tokenizer, ids)
    assert pieces == ["a", "", ""]
    assert "".join(pieces) + rest == byte_tokenizer.decode(ids)
    assert rest.startswith("\ufffd")


class _CountingTokenizer:
    """Wraps a tokenizer and records the longest id list it was asked to decode (by transformers'
    decode or, as the detokenizer calls it, its Rust backend's)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.longest = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    @property
    def backend_tokenizer(self) -> Any:
        return _CountingBackend(self, self._tokenizer.backend_tokenizer)

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        self.longest = max(self.longest, len(ids))
        return self._tokenizer.decode(ids, **kwargs)


class _CountingBackend:
    def __init__(self, counter: _CountingTokenizer, backend: Any) -> None:
        self.counter, self.backend = counter, backend

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        self.counter.longest = max(self.counter.longest, len(ids))
        return self.backend.decode(ids, **kwargs)


def test_each_step_decodes_a_bounded_window(byte_tokenizer: Any) -> None:
    reserved = byte_tokenizer.convert_tokens_to_ids("<|reserved_0|>")
    text = "".join(TEXTS) * 20
    # Long output, a long run of skipped special tokens after a half character,
    # and a long run of bytes that never form a character.
    ids = (
        byte_tokenizer.encode(text, add_special_tokens=False)
        + [0xE4]
        + [reserved] * 500
        + [0x9F] * 500
        + [65]
    )
    counting = _CountingTokenizer(byte_tokenizer)
    pieces, rest, _ = stream(counting, ids, stop=["never appears"])
    # The context and the pending tokens, each at most MAX_PENDING_TOKENS + 1 long.
    assert 0 < counting.longest <= 2 * MAX_PENDING_TOKENS + 2 < len(ids) / 10
    assert "".join(pieces) + rest == byte_tokenizer.decode(ids, skip_special_tokens=True)
