"""Structured outputs: xgrammar's token masks, so that a guided request's output matches its
GuidedSpec.

One GuidedDecoding per worker process. Importing xgrammar takes seconds, so it happens on background
threads only: the compile thread loads the tokenizer, then compiles each spec once (requests with
one spec share the compile); the fill thread owns every request's GrammarMatcher, and fill,
fill_async and release run there in call order, so matcher state needs no lock. A matcher catches up
from the request's output token ids at each fill: whichever process sampled the earlier tokens, the
list is the truth.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import torch

from engine.sampling_params import GuidedSpec, RequestFailure

if TYPE_CHECKING:
    import xgrammar as xgr

GuidedRow = tuple[
    str, GuidedSpec, Sequence[int]
]  # (request id, spec, the request's output token ids so far)
MAX_COMPILED = 256  # specs whose compiled grammar stays cached (live matchers keep their own)
PARALLEL_FROM = (
    16  # rows from which several threads fill faster than one (below, thread start-up costs more)
)
# What each kind's value is and how to fix it, for the messages users see (the API server prefixes
# the field).
_KINDS = {
    "json_schema": ("the schema", "fix the schema or leave out what xgrammar rejects"),
    "json_object": ("json_object", "report this as a bug"),
    "regex": ("the regex", "fix the regex"),
    "choice": ("the choice list", "send the choices as a JSON list of strings"),
    "grammar": ("the grammar", "write it in EBNF (GBNF) with a rule named root"),
    "structural_tag": ("the structural tag", "fix it to xgrammar's structural tag format"),
}
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
# xgrammar 0.2.8 writes a string with minLength/maxLength as repeats of this class, which admits raw
# control characters: invalid JSON (json.loads rejects a raw tab;
# github.com/mlc-ai/xgrammar/issues/800). Such a string still cannot hold escapes: adding them made
# filling its masks four times slower.
_BOUNDED_CHAR = r"[^\"\\\r\n]"
_JSON_CHAR = r"[^\"\\\0-\x1f]"
# xgrammar 0.2.8's numbers have as many digits as a model writes: one that never stops writing
# digits runs to max_tokens. JSON numbers past 16 significant digits are not exact in a float64
# (nor in JavaScript) anyway, so a number's whole part is capped at 16 digits, its fraction at 16
# and its exponent at 3 (1e308 is float64's largest). A schema's minimum/maximum bound an integer
# further (xgrammar writes its range). vLLM's xgrammar backend applies no such cap.
_DIGIT_CAPS = (
    ("[1-9] [0-9]*", "[1-9] [0-9]{0, 15}"),
    ('"." basic_number_digits{1, -1}', '"." basic_number_digits{1, 16}'),
    ("basic_number_4 basic_number_digits{1, -1}", "basic_number_4 basic_number_digits{1, 3}"),
)


class GuidedError(RequestFailure, ValueError):
    """A guided request cannot go on: its spec does not compile, or its output left the grammar."""


def spec_problem(spec: GuidedSpec) -> str | None:
    """Why xgrammar cannot build this spec's grammar (one line naming the fix), or None when it can.
    Needs no tokenizer: the API server calls it to refuse a request before it reaches a worker."""
    try:
        _grammar(spec)
    except GuidedError as e:
        return str(e)
    return None


def _grammar(spec: GuidedSpec) -> xgr.Grammar:
    """The spec's grammar; GuidedError with spec_problem's message when there is none."""
    import xgrammar as xgr

    what, fix = _KINDS[spec.kind]
    try:
        if spec.kind in ("json_schema", "json_object"):
            schema = spec.value if spec.kind == "json_schema" else '{"type": "object"}'
            json.loads(
                schema
            )  # Python's message says where the JSON breaks; xgrammar's quotes the whole text
            # Fixed separators and strict mode: a model cannot pad with whitespace or invent
            # properties forever.
            text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
            for unbounded, capped in _DIGIT_CAPS:
                text = text.replace(unbounded, capped)
            return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_CHAR, _JSON_CHAR))
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            if not (
                isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)
            ):
                raise GuidedError(
                    f"{what} must be a JSON list of at least one string, got {spec.value[:100]}"
                )
            # A JSON string literal is an EBNF one: xgrammar reads \" \\ \n \uXXXX and raw UTF-8
            # alike.
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            )
        if spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.value)
        return xgr.Grammar.from_structural_tag(spec.value)
    except json.JSONDecodeError as e:
        raise GuidedError(f"{what} is not valid JSON ({e}); {fix}") from e
    except GuidedError:
        raise
    except (
        Exception
    ) as e:  # xgrammar raises RuntimeError and its subclasses, a bad surrogate UnicodeEncodeError
        reason = _CPP_PREFIX.sub("", (str(e).strip() or type(e).__name__).splitlines()[0]).rstrip(
            "."
        )
        raise GuidedError(f"{what} cannot be compiled: {reason[:300]}; {fix}") from e


@dataclass
class _Matcher:
    spec: GuidedSpec
    matcher: xgr.GrammarMatcher
    accepted: int = 0  # leading output tokens it has accepted


class GuidedDecoding:
    """Grammar masks for the guided rows of a batch. vocab_size is the model's (the logits' width),
    which may exceed the tokenizer's: the ids past it are never allowed. pin: keep the masks in
    pinned memory (GPU workers). tokenizer_path None: structured outputs cannot run here, and fill
    raises GuidedError for a guided request."""

    def __init__(
        self,
        tokenizer_path: str | None,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        pin: bool = False,
    ) -> None:
        self.tokenizer_path, self.vocab_size, self.pin = tokenizer_path, vocab_size, pin
        self.eos_token_ids = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self.width = (vocab_size + 31) // 32
        self._threads = max(
            1, len(os.sched_getaffinity(0)) // 2
        )  # for xgrammar's compile and batch fill
        self._compile_thread = ThreadPoolExecutor(1, thread_name_prefix="guided-compile")
        self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="guided-fill")
        self._lock = (
            threading.Lock()
        )  # guards the two below: start runs on the caller's thread, fills on theirs
        self._compiler: Future[xgr.GrammarCompiler] | None = None
        self._compiled: OrderedDict[GuidedSpec, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._matchers: dict[str, _Matcher] = {}  # fill thread only
        self._fillers: tuple[xgr.BatchGrammarMatcher, xgr.BatchGrammarMatcher] | None = (
            None  # fill thread only
        )
        # Two buffers take turns, so a step's masks survive while the next step's are filled.
        self._buffers = [self._new_buffer(0), self._new_buffer(0)]
        self._turn = 0
        words = [0] * self.width
        for t in self.eos_token_ids:
            words[t // 32] |= 1 << (t % 32)
        self._stop_row = torch.tensor(
            [w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32
        )
        self._free_row = torch.full((self.width,), -1, dtype=torch.int32)  # every token allowed

    @property
    def available(self) -> bool:
        """Whether this worker can run guided requests (it was given a tokenizer)."""
        return self.tokenizer_path is not None

    def warm(self) -> None:
        """Begin loading the tokenizer and xgrammar in the background (else the first guided request
        does)."""
        with self._lock:
            self._warm_locked()

    def start(self, request_id: str, spec: GuidedSpec) -> None:
        """Begin compiling the request's grammar in the background; returns at once (fill waits for
        it). Never raises: a request that cannot be guided here (no tokenizer, a spec that does not
        compile) fails at its first fill with a GuidedError naming it, which ends that request
        alone."""
        if self.available:
            self._compile(spec)

    def fill(self, rows: Sequence[GuidedRow]) -> torch.Tensor:
        """The masks of rows (int32 [len(rows), ceil(vocab_size / 32)] on the CPU; bit t of row i
        set: token t allowed), after each request's matcher accepted its new output tokens. A
        request whose grammar has ended may only stop. Raises GuidedError naming the request when
        its grammar failed to compile or its output left the grammar. The tensor is reused by the
        fill after next."""
        return self.fill_async(rows).result()

    def fill_async(self, rows: Sequence[GuidedRow]) -> Future[torch.Tensor]:
        """fill on the fill thread: start it before launching a step and join after. The token lists
        must not change until the future is done."""
        return self._fill_thread.submit(self._fill, list(rows))

    def release(self, request_id: str) -> None:
        """Forget a finished request's matcher (after any fill already submitted)."""
        self._fill_thread.submit(self._matchers.pop, request_id, None)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
        """Set to -inf, in place, the disallowed tokens of float32 logits [B, vocab_size], row
        indices[k] by bitmask row k (a fill's result for those rows, in that order). On a GPU the
        mask is copied asynchronously: the device must have synced (the sampler does, reading its
        tokens) before the fill after next."""
        import xgrammar as xgr

        if not indices:
            return
        bitmask = bitmask.to(logits.device, non_blocking=True)
        if indices != list(range(len(indices))):
            # xgrammar reads mask row i for logits row i: spread our rows to where theirs are.
            full = torch.full(
                (logits.shape[0], self.width), -1, dtype=torch.int32, device=logits.device
            )
            full[torch.tensor(indices, device=logits.device)] = bitmask
            bitmask = full
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices)

    def close(self) -> None:
        """Stop the background threads (after their queued work)."""
        self._compile_thread.shutdown()
        self._fill_thread.shutdown()

    # ---- compile thread --------------------------------------------------------------------------

    def _warm_locked(self) -> None:
        if self._compiler is None and self.available:
            self._compiler = self._compile_thread.submit(self._load)

    def _load(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr

        from engine.tokenizer import auto_tokenizer

        try:
            tokenizer = auto_tokenizer(self.tokenizer_path)
        except Exception as e:
            raise GuidedError(
                f"structured outputs cannot start: the tokenizer {self.tokenizer_path} does not "
                f"load ({e}); start the server with a tokenizer transformers can load"
            ) from e
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
        )
        # xgrammar 0.2.8 takes special tokens (<|user|>) for their text, so a schema's string could
        # hold one: give them no text, which it never allows (the stop tokens it allows by id).
        vocab = [""] * self.vocab_size
        for token, i in tokenizer.get_vocab().items():
            if i < self.vocab_size:
                vocab[i] = token
        for i, added in tokenizer.added_tokens_decoder.items():
            if added.special and i < self.vocab_size:
                vocab[i] = ""
        info = xgr.TokenizerInfo.from_vocab_and_metadata(vocab, info.dump_metadata())
        return xgr.GrammarCompiler(info, max_threads=self._threads)

    def _compile(self, spec: GuidedSpec) -> Future[xgr.CompiledGrammar]:
        if not self.available:
            raise GuidedError(
                "structured outputs need a tokenizer, and this worker runs without one "
                "(--skip-tokenizer-init): start the server with a tokenizer, or send the request "
                "without "
                "structured outputs (response_format, structured_outputs, guided_*)"
            )
        spec = msgspec.structs.replace(spec, after=())  # one grammar, wherever it starts
        with self._lock:
            if (future := self._compiled.get(spec)) is not None:
                self._compiled.move_to_end(spec)
                return future
            self._warm_locked()
            future = self._compile_thread.submit(self._build, spec)
            self._compiled[spec] = future
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
            return future

    def _build(self, spec: GuidedSpec) -> xgr.CompiledGrammar:
        assert (
            self._compiler is not None
        )  # _compile warmed first, and this thread runs jobs in order
        return self._compiler.result().compile_grammar(_grammar(spec))

    # ---- fill thread -----------------------------------------------------------------------------

    def _new_buffer(self, rows: int) -> torch.Tensor:
        return torch.empty(rows, self.width, dtype=torch.int32, pin_memory=self.pin)

    def _fill(self, rows: list[GuidedRow]) -> torch.Tensor:
        import xgrammar as xgr

        if self._fillers is None:
            # batch_fill releases the GIL (a single matcher's fill holds it), so the main thread
            # runs meanwhile.
            self._fillers = (xgr.BatchGrammarMatcher(1), xgr.BatchGrammarMatcher(self._threads))
        self._turn ^= 1
        if self._buffers[self._turn].shape[0] < len(rows):
            self._buffers[self._turn] = self._new_buffer(
                max(len(rows), 2 * self._buffers[self._turn].shape[0])
            )
        out = self._buffers[self._turn][: len(rows)]
        live: list[xgr.GrammarMatcher] = []
        at: list[int] = []
        for k, (request_id, spec, tokens) in enumerate(rows):
            held = grammar_tokens(spec, tokens)
            if held is None:  # still before the grammar's start (thinking)
                out[k] = self._free_row
                continue
            matcher = self._catch_up(request_id, spec, held)
            if matcher.is_terminated():  # xgrammar refuses to fill after a stop token
                out[k] = self._stop_row
            else:
                live.append(matcher)
                at.append(k)
        if live:
            self._fillers[len(live) >= PARALLEL_FROM].batch_fill_next_token_bitmask(live, out, at)
        return out

    def _catch_up(
        self, request_id: str, spec: GuidedSpec, tokens: Sequence[int]
    ) -> xgr.GrammarMatcher:
        """The request's matcher, after it accepted every token of its output."""
        import xgrammar as xgr

        state = self._matchers.get(request_id)
        if state is None or state.spec != spec or state.accepted > len(tokens):
            try:
                compiled = self._compile(spec).result()
            except Exception as e:  # the spec's GuidedError, or the tokenizer's start-up failing
                raise GuidedError(f"request {request_id}: {e}") from e
            state = self._matchers[request_id] = _Matcher(spec, xgr.GrammarMatcher(compiled))
        for i in range(state.accepted, len(tokens)):
            if not state.matcher.accept_token(tokens[i]):
                del self._matchers[request_id]
                raise GuidedError(
                    f"request {request_id}: output token {tokens[i]} (index {i}) does not fit its "
                    f"{spec.kind} grammar; its tokens must come from this grammar's masks"
                )
            state.accepted += 1
        return state.matcher


def grammar_tokens(spec: GuidedSpec, tokens: Sequence[int]) -> Sequence[int] | None:
    """The output tokens spec's grammar holds for: all of them, or those after the first
    occurrence of spec.after (None: it has not occurred yet)."""
    n = len(spec.after)
    if not n:
        return tokens
    for i in range(len(tokens) - n + 1):
        if tokens[i] == spec.after[0] and tuple(tokens[i : i + n]) == spec.after:
            return tokens[i + n :]
    return None
