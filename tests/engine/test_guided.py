"""Structured outputs: a random model, masked by GuidedDecoding, always writes text that matches the
spec."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import msgspec
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from engine.demo import write_byte_tokenizer
from engine.guided import GuidedDecoding, GuidedError, spec_problem
from engine.sampling_params import GuidedSpec

BYTE_EOS, BYTE_VOCAB = (
    261,
    352,
)  # the demo tokenizer has 320 tokens: the model's 32 more must never be allowed
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "active", "address"],
}
CHOICES = ["yes", "no", 'say "hi"', "back\\slash", "new\nline", "héllo ✓ 🎉", "tab\there"]
REGEX = r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)"
EBNF = 'root ::= answer (", " answer)*\nanswer ::= "yes" | "no" | "maybe"'
SPECS = {
    "json_schema": GuidedSpec("json_schema", json.dumps(SCHEMA)),
    "json_object": GuidedSpec("json_object"),
    "regex": GuidedSpec("regex", REGEX),
    "choice": GuidedSpec("choice", json.dumps(CHOICES)),
    "grammar": GuidedSpec("grammar", EBNF),
}
CHECKS: dict[str, Callable[[str], bool]] = {
    "json_schema": lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None,
    "json_object": lambda text: isinstance(json.loads(text), dict),
    "regex": lambda text: re.fullmatch(REGEX, text) is not None,
    "choice": lambda text: text in CHOICES,
    "grammar": lambda text: re.fullmatch(r"(yes|no|maybe)(, (yes|no|maybe))*", text) is not None,
}


class Setup:
    """A tokenizer folder, its GuidedDecoding and what the simulation needs to know of it."""

    def __init__(self, folder: Path, vocab_size: int, eos: int) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.guided = GuidedDecoding(str(folder), vocab_size, [eos])
        self.eos, self.size = eos, len(self.tokenizer)
        self.specials = set(self.tokenizer.all_special_ids) | {
            i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special
        }
        # json_object: a random model almost never closes a string or an object; favour the tokens
        # that do, quotes the most, else half of all objects would be {}.
        self.closers = torch.zeros(vocab_size)
        for i in range(self.size):
            text = self.tokenizer.decode([i])
            if i not in self.specials and text and set(text) <= set('"}]'):
                self.closers[i] = 6.0 if '"' in text else 4.0


def train_bpe(folder: Path) -> None:
    """A byte-level BPE with a few hundred merges of English and JSON, so tokens span several
    characters."""
    english = "The quick brown fox jumps over the lazy dog while the answer stays yes or no. " * 20
    samples = [
        json.dumps(
            {
                "name": f"user{i}",
                "age": i % 99,
                "role": ["admin", "user"][i % 2],
                "active": i % 3 == 0,
                "tags": ["ab", "c"][: i % 3],
                "address": {"city": "Paris", "zip": 10000 + i},
            }
        )
        for i in range(300)
    ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<|end|>", "<|user|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([english, *samples], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|end|>",
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def byte_setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    folder = tmp_path_factory.mktemp("byte-tokenizer")
    write_byte_tokenizer(folder)
    setup = Setup(folder, BYTE_VOCAB, BYTE_EOS)
    yield setup
    setup.guided.close()


@pytest.fixture(scope="module")
def bpe_setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    folder = tmp_path_factory.mktemp("bpe-tokenizer")
    train_bpe(folder)
    setup = Setup(
        folder, 704, 0
    )  # <|end|> is id 0; the model's vocabulary is padded past the tokenizer's
    yield setup
    setup.guided.close()


def allowed(bitmask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool [vocab_size] a bitmask row allows."""
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].bool()


def simulate(setup: Setup, mode: str, seeds: range, cap: int) -> list[str]:
    """One random 'model' per seed, all in one batch with an unguided row in front: fill, apply,
    sample, until each row samples EOS. Checks every mask on the way; returns the texts."""
    guided, vocab = setup.guided, setup.guided.vocab_size
    generators = {s: torch.Generator().manual_seed(s) for s in seeds}
    outputs: dict[int, list[int]] = {s: [] for s in seeds}
    texts: dict[int, str] = {}
    for _ in range(cap):
        live = [s for s in seeds if s not in texts]
        if not live:
            return [texts[s] for s in seeds]
        bitmask = guided.fill([(f"{mode}-{s}", SPECS[mode], outputs[s]) for s in live])
        assert bitmask.shape == (len(live), (vocab + 31) // 32) and bitmask.dtype == torch.int32
        logits = torch.randn(len(live) + 1, vocab)
        for k, s in enumerate(live):
            logits[k + 1] = 2.0 * torch.randn(vocab, generator=generators[s])
        if mode == "json_object":
            logits[1:] += setup.closers
        before = logits[0].clone()
        guided.apply(logits, bitmask, list(range(1, len(live) + 1)))
        assert torch.equal(logits[0], before), "the unguided row must be left alone"
        for k, s in enumerate(live):
            ok = allowed(bitmask[k], vocab)
            assert not ok[setup.size :].any(), (
                "ids past the tokenizer's vocabulary must never be allowed"
            )
            assert all(not ok[i] for i in setup.specials - {setup.eos}), (
                "special tokens are not text"
            )
            assert torch.equal(torch.isfinite(logits[k + 1]), ok)
            token = int(
                torch.multinomial(torch.softmax(logits[k + 1], -1), 1, generator=generators[s])
            )
            if token == setup.eos:
                texts[s] = setup.tokenizer.decode(outputs[s])
                guided.release(f"{mode}-{s}")
            else:
                outputs[s].append(token)
    raise AssertionError(
        f"{mode}: rows {[s for s in seeds if s not in texts]} did not stop within {cap} tokens"
    )


@pytest.mark.parametrize("mode", list(SPECS))
@pytest.mark.parametrize("which", ["byte_setup", "bpe_setup"])
def test_random_model_output_matches_spec(
    mode: str, which: str, request: pytest.FixtureRequest
) -> None:
    texts = simulate(request.getfixturevalue(which), mode, range(20), cap=400)
    for text in texts:
        assert CHECKS[mode](text), f"{mode}: {text!r}"
    assert len(set(texts)) > 1, "different seeds should write different outputs"


def test_every_choice_is_reachable_with_its_escapes(byte_setup: Setup) -> None:
    for k, choice in enumerate(CHOICES):
        tokens = list(choice.encode())
        bitmask = byte_setup.guided.fill([(f"reach-{k}", SPECS["choice"], tokens)])
        assert allowed(bitmask[0], BYTE_VOCAB)[BYTE_EOS], f"{choice!r} should be complete"
        byte_setup.guided.release(f"reach-{k}")
    with pytest.raises(GuidedError, match="request wrong"):
        byte_setup.guided.fill(
            [("wrong", SPECS["choice"], list(b'say \\"'))]
        )  # the escape is not the text


def test_bounded_strings_hold_no_control_characters(byte_setup: Setup) -> None:
    """xgrammar 0.2.8 lets a maxLength string hold a raw tab: invalid JSON."""
    spec = GuidedSpec("json_schema", json.dumps({"type": "string", "maxLength": 3}))
    ok = allowed(byte_setup.guided.fill([("bounded", spec, list(b'"'))])[0], BYTE_VOCAB)
    assert (
        ok[ord("a")]
        and ok[ord('"')]
        and ok[0xC3]
        and not ok[ord("\t")]
        and not ok[0]
        and not ok[0x1F]
    )


def test_catch_up_from_the_token_list(byte_setup: Setup) -> None:
    guided, spec = byte_setup.guided, SPECS["json_object"]
    a, b, c = ord("{"), ord('"'), ord("k")
    guided.fill([("up", spec, [a])])
    stepped = guided.fill([("up", spec, [a, b, c])]).clone()  # two new tokens at once
    fresh = guided.fill([("fresh", spec, [a, b, c])]).clone()
    assert torch.equal(stepped, fresh)
    guided.release("up")
    assert torch.equal(guided.fill([("up", spec, [a, b, c])]), fresh), (
        "a released request rebuilds from its tokens"
    )
    shorter = guided.fill(
        [("up", spec, [a])]
    ).clone()  # the list no longer extends what was accepted: rebuild
    assert torch.equal(shorter, guided.fill([("short", spec, [a])]))
    with pytest.raises(GuidedError, match=r"request nope: output token 120 \(index 1\)"):
        guided.fill([("nope", spec, [a, ord("x")])])


def test_terminated_request_may_only_stop(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path)
    guided = GuidedDecoding(str(tmp_path), BYTE_VOCAB, [BYTE_EOS, 257])
    ok = allowed(guided.fill([("done", SPECS["choice"], [*b"no", BYTE_EOS])])[0], BYTE_VOCAB)
    assert ok.nonzero().flatten().tolist() == [257, BYTE_EOS]
    guided.close()


def test_fill_async_matches_fill(bpe_setup: Setup) -> None:
    guided = bpe_setup.guided
    prefix = bpe_setup.tokenizer.encode('{"name": "ab", "age": 7')
    rows = [(f"async-{i}", SPECS["json_schema"], prefix[:i]) for i in range(len(prefix))]
    rows += [
        ("async-c", SPECS["choice"], []),
        ("async-r", SPECS["regex"], bpe_setup.tokenizer.encode("ab@")),
    ]
    expected = guided.fill(rows).clone()
    assert torch.equal(guided.fill_async(rows).result(), expected)
    for request_id, _, _ in rows:
        guided.release(request_id)
    assert torch.equal(guided.fill_async(rows).result(), expected)


def test_one_compile_per_spec_and_compile_errors_name_the_request(byte_setup: Setup) -> None:
    guided = byte_setup.guided
    spec = GuidedSpec("regex", "[0-9]{4}")
    guided.start("x", spec)
    guided.start("y", spec)
    assert guided._compiled[spec] is guided._compile(spec)
    with pytest.raises(
        GuidedError, match=r"request bad-regex: the regex cannot be compiled: .*closed"
    ):
        guided.fill([("bad-regex", GuidedSpec("regex", "(ab"), [])])


def test_without_a_tokenizer_guided_requests_fail_at_their_first_fill_naming_the_fix() -> None:
    guided = GuidedDecoding(None, 320, [BYTE_EOS])
    assert not guided.available
    guided.start("r", SPECS["regex"])  # the worker's loop calls it: it must not raise
    with pytest.raises(
        GuidedError,
        match="request r: structured outputs need a tokenizer.*--skip-tokenizer-init.*"
        "start the server with a tokenizer",
    ):
        guided.fill([("r", SPECS["regex"], [])])


@pytest.mark.parametrize(
    "spec, problem",
    [
        (GuidedSpec("json_schema", '{"type": "object"'), "^the schema is not valid JSON"),
        (
            GuidedSpec("json_schema", '{"type": "objectx"}'),
            'cannot be compiled: Unsupported type "objectx"; fix',
        ),
        (
            GuidedSpec("json_schema", '{"type": "integer", "minimum": 5, "maximum": 2}'),
            "minimum greater than maximum",
        ),
        (GuidedSpec("regex", "(ab"), "^the regex cannot be compiled: Regex parsing error"),
        (GuidedSpec("regex", "a(?=b)"), "Lookahead is not supported"),
        (GuidedSpec("choice", "[]"), "^the choice list must be a JSON list of at least one string"),
        (GuidedSpec("choice", '["a", 1]'), "must be a JSON list of at least one string"),
        (GuidedSpec("choice", '"a"'), "must be a JSON list of at least one string"),
        (GuidedSpec("choice", "[a]"), "^the choice list is not valid JSON"),
        (
            GuidedSpec("grammar", "root ::= foo"),
            '^the grammar cannot be compiled: .*"foo" is not defined',
        ),
        (GuidedSpec("grammar", 'start ::= "a"'), "root.*not found; write it in EBNF"),
        (
            GuidedSpec("structural_tag", "{}"),
            "^the structural tag cannot be compiled: .*must have a format field",
        ),
    ],
)
def test_spec_problem_names_the_problem(spec: GuidedSpec, problem: str) -> None:
    message = spec_problem(spec)
    assert message is not None and re.search(problem, message), message
    assert "\n" not in message and "/project/" not in message


@pytest.mark.parametrize(
    "spec",
    [
        *SPECS.values(),
        GuidedSpec("choice", '["only"]'),
        GuidedSpec(
            "json_schema",
            '{"type": "array", "items": {"$ref": "#/$defs/n"}, "$defs": {"n": {"type": "number"}}}',
        ),
        GuidedSpec(
            "structural_tag",
            json.dumps(
                {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
            ),
        ),
    ],
)
def test_spec_problem_accepts_good_specs(spec: GuidedSpec) -> None:
    assert spec_problem(spec) is None


@pytest.mark.gpu
def test_cuda_apply_matches_cpu(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    write_byte_tokenizer(tmp_path)
    guided = GuidedDecoding(str(tmp_path), BYTE_VOCAB, [BYTE_EOS], pin=True)
    bitmask = guided.fill([("g0", SPECS["regex"], []), ("g1", SPECS["choice"], list(b"ye"))])
    assert bitmask.is_pinned()
    logits = torch.randn(3, BYTE_VOCAB)
    on_gpu = logits.cuda()
    guided.apply(logits, bitmask, [0, 2])
    guided.apply(on_gpu, bitmask, [0, 2])
    assert torch.equal(on_gpu.cpu(), logits)
    guided.close()


def test_a_grammar_after_thinking_holds_from_the_end_of_the_thinking(byte_setup: Setup) -> None:
    """A reasoning model's structured output (GuidedSpec.after = </think>'s ids): nothing is
    masked while it thinks, and from the end of its thinking on the mask is the grammar's over
    the tokens that follow, as if they were the whole output."""
    guided = byte_setup.guided
    spec = msgspec.structs.replace(SPECS["choice"], after=tuple(b"</think>"))
    thinking = guided.fill([("think", spec, list(b"hm, </think"))])[0]
    assert allowed(thinking, BYTE_VOCAB).all(), "nothing masked before the thinking ends"
    answer = list(CHOICES[0].encode())[:2]
    for done in ([], answer):
        after = guided.fill([("think", spec, [*b"hm</think>", *done])])[0].clone()
        plain = guided.fill([(f"plain-{len(done)}", SPECS["choice"], done)])[0]
        assert torch.equal(after, plain)
    with pytest.raises(GuidedError, match="request off"):
        guided.fill([("off", spec, [*b"hm</think>", *b"~~"])])
    for request in ("think", "plain-0", f"plain-{len(answer)}"):
        guided.release(request)


def test_json_numbers_stop_at_a_digit_cap(byte_setup: Setup) -> None:
    """A strict json_schema number cannot grow until max_tokens: its whole part takes 16 digits at
    most, its fraction 16, its exponent 3."""
    guided = byte_setup.guided
    spec = GuidedSpec("json_schema", json.dumps({"type": "number"}))
    digits = [ord(c) for c in "0123456789"]

    def next_allowed(text: str) -> torch.Tensor:
        request = f"digits-{len(text)}-{text[-3:]}"
        row = allowed(guided.fill([(request, spec, list(text.encode()))])[0], BYTE_VOCAB)
        guided.release(request)
        return row

    for text, more in (
        ("9" * 15, True),
        ("9" * 16, False),
        ("1." + "5" * 15, True),
        ("1." + "5" * 16, False),
        ("1e30", True),
        ("1e308", False),
    ):
        assert bool(next_allowed(text)[digits].any()) == more, text
    assert next_allowed("9" * 16)[BYTE_EOS], "a number of 16 digits is complete"
