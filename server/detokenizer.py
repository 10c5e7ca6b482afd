"""Incremental detokenization of a stream of generated token ids, with stop strings.

Text is produced the way vLLM produces it (prefix_offset/read_offset): each
step decodes only a short window, the tokens of the last emitted piece (as
context, so tokenizers that strip a leading space at the start of a decode still
produce the right text) plus the tokens not yet turned into text. The cost per
token is therefore O(1) amortized, whatever the output length.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"
# Valid text reaches a character boundary within a few tokens (a UTF-8 character
# is at most 4 bytes). A window still ending in U+FFFD after this many tokens
# holds invalid bytes (a random model emits them): emitting it as it is keeps
# the window, and so the cost per token, bounded.
MAX_PENDING_TOKENS = 64


_SPECIAL_IDS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of a tokenizer's special tokens, read once per tokenizer (transformers rebuilds the
    added-token table on every read, which per request cost more than a short answer's
    detokenizing)."""
    if (ids := _SPECIAL_IDS.get(tokenizer)) is None:
        added = getattr(tokenizer, "added_tokens_decoder", {})
        ids = frozenset(
            {i for i, token in added.items() if getattr(token, "special", False)}
            | set(tokenizer.all_special_ids)
        )
        _SPECIAL_IDS[tokenizer] = ids
    return ids


class IncrementalDetokenizer:
    """Turns token ids into text as they arrive, stopping at the first stop string.

    `add` returns only text that is final: never half a UTF-8 character, never a
    tail that could still become a stop string. Stop strings are not part of the
    output (OpenAI semantics). `flush` at the end returns what was held back.
    """

    def __init__(
        self,
        tokenizer: Any,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        drop_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.stopped = False
        self.stop_string: str | None = None  # which stop string ended the text
        self.text = ""
        self._max_stop = max((len(s) for s in self.stop), default=0)
        # Special tokens decode to nothing when skipped: dropping them up front
        # keeps a long run of them from growing the window.
        self._skipped_ids: frozenset[int] = frozenset(drop_ids)  # ids that never become text
        if skip_special_tokens:
            self._skipped_ids |= special_ids(tokenizer)
        # A fast tokenizer's Rust decoder, called directly: with clean_up_tokenization_spaces off,
        # transformers' decode returns exactly what it does, after several Python layers that cost
        # more than the decoding.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode_ids = backend.decode if backend is not None else self._decode_slow
        self._window: list[int] = []  # context tokens, then tokens not yet turned into text
        self._read = 0  # self._window[:self._read] is the context
        self._context_text = ""  # the decoded context
        self._unsent = ""  # text decoded but held back: it may begin a stop string

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the new text safe to send now ("" after a stop)."""
        if self.stopped:
            return ""
        # One token at a time, so that a chunk ending inside a character still
        # releases the complete characters before it.
        new_text = "".join(self._decode_new(token_id) for token_id in token_ids)
        return self._emit(new_text, final=False)

    def flush(self) -> str:
        """Return all text held back, at the end of the request.

        An incomplete UTF-8 character at the very end comes out as U+FFFD, as
        tokenizer.decode renders it.
        """
        if self.stopped:
            return ""
        return self._emit(self._decode_new(None), final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_slow(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _decode_new(self, token_id: int | None) -> str:
        """Add one token (None: the end of the output) and return the text it completes."""
        if token_id is not None:
            if token_id in self._skipped_ids:
                return ""
            self._window.append(token_id)
        pending = len(self._window) - self._read
        if pending == 0:
            return ""
        text = self._decode(self._window)
        # Wait while the last character is incomplete, or while the new tokens
        # added no character yet (vLLM's condition).
        waiting = text.endswith(REPLACEMENT_CHAR) or len(text) <= len(self._context_text)
        if waiting and token_id is not None and pending <= MAX_PENDING_TOKENS:
            return ""
        new_text = text[len(self._context_text) :]
        # The tokens just read become the context of the next window.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._context_text = self._decode(self._window)
        return new_text

    def _emit(self, new_text: str, final: bool) -> str:
        """Cut at the first stop string; hold back a tail that could begin one."""
        unsent = self._unsent + new_text
        if self.stop:
            # The held-back tail contains no whole stop string, so searching
            # tail + new text finds every new match, and the earliest one wins.
            hits = [(i, s) for s in self.stop if (i := unsent.find(s)) >= 0]
            if hits:
                cut, self.stop_string = min(hits, key=lambda hit: hit[0])
                self.stopped = True
                self._unsent = ""
                self.text += unsent[:cut]
                return unsent[:cut]
        hold = 0 if final else self._stop_prefix_length(unsent)
        out, self._unsent = unsent[: len(unsent) - hold], unsent[len(unsent) - hold :]
        self.text += out
        return out

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for length in range(min(len(text), self._max_stop - 1), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self.stop):
                return length
        return 0


class Detokenizer(Protocol):
    stopped: bool
    stop_string: str | None
    text: str

    def add(self, token_ids: Sequence[int]) -> str: ...
    def flush(self) -> str: ...


class NoDetokenizer:
    """Stands in when the server runs without a tokenizer (--skip-tokenizer-init): answers are token
    ids only."""

    stopped = False
    stop_string = None
    text = ""

    def add(self, token_ids: Sequence[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


def make_detokenizer(
    tokenizer: Any, stop: Sequence[str] = (), keep_special_except: Sequence[int] | None = None
) -> Detokenizer:
    """The detokenizer of one choice. keep_special_except: keep special tokens in the text (a
    tool-call parser reads markers such as [TOOL_CALLS]), except these ids (the stop tokens,
    which end the output and are not part of it); None or empty: skip every special token, as
    OpenAI's text has none."""
    if tokenizer is None:
        return NoDetokenizer()
    if not keep_special_except:
        return IncrementalDetokenizer(tokenizer, stop)
    return IncrementalDetokenizer(
        tokenizer, stop, skip_special_tokens=False, drop_ids=keep_special_except
    )
