"""Structured outputs on each tiny architecture, through the engine: 20 seeded requests per mode in
one batch, each output parses and matches its spec (the models' weights are random, so only the
grammar masks make it so)."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest

from engine.demo import write_byte_tokenizer
from engine.engine import Engine, EngineConfig
from engine.model_runner import StepInput
from engine.sampler import Row
from engine.sampling_params import GuidedSpec, SamplingParams
from engine.shared_memory import release_name
from tests.tiny_models import ARCHS, write_tiny_model

SEEDS = 20
MAX_OUTPUT = 120
EOS = 261  # the byte tokenizer's <|end|>, which the models are told is theirs
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": -9, "maximum": 99},
        "pick": {"enum": ["a", "b"]},
    },
    "required": ["ok", "n", "pick"],
    "additionalProperties": False,
}
MODES = {
    "json_schema": (
        GuidedSpec("json_schema", json.dumps(SCHEMA)),
        lambda t: jsonschema.validate(json.loads(t), SCHEMA),
    ),
    "regex": (
        GuidedSpec("regex", r"(ab|cd)[0-9]{1,3}"),
        lambda t: re.fullmatch(r"(ab|cd)[0-9]{1,3}", t) or pytest.fail(t),
    ),
    "choice": (
        GuidedSpec("choice", json.dumps(["yes", "no"])),
        lambda t: t in ("yes", "no") or pytest.fail(t),
    ),
    "grammar": (
        GuidedSpec("grammar", 'root ::= "[" [0-9] ("," [0-9]){0,2} "]"'),
        lambda t: re.fullmatch(r"\[[0-9](,[0-9]){0,2}\]", t) or pytest.fail(t),
    ),
}


@pytest.fixture(scope="module", params=ARCHS)
def engine(request, tmp_path_factory) -> Engine:
    folder = write_tiny_model(
        tmp_path_factory.mktemp(request.param), request.param, eos_token_id=EOS
    )
    write_byte_tokenizer(folder)
    cfg = EngineConfig(
        model=str(folder), num_kv_blocks=SEEDS * 12, max_num_seqs=SEEDS, tokenizer=str(folder)
    )
    names = (
        f"ppd-test-{os.getpid()}-{request.param}-w",
        f"ppd-test-{os.getpid()}-{request.param}-kv",
    )
    engine = Engine.create(cfg, names)
    yield engine
    release_name(engine.weights_handle)
    release_name(engine.kv_handle)


def generate(engine: Engine, spec: GuidedSpec) -> list[list[int]]:
    """Greedy-free decoding of SEEDS requests in one batch until each samples EOS; their outputs
    without it."""
    prompt = list(b"Answer: ")
    rows = [
        Row(
            SamplingParams(temperature=1.0, seed=s, guided=spec, max_tokens=MAX_OUTPUT),
            list(prompt),
            len(prompt),
            f"{spec.kind}-{s}",
        )
        for s in range(SEEDS)
    ]
    tables = [list(range(i * 12, (i + 1) * 12)) for i in range(SEEDS)]
    done: dict[int, list[int]] = {}
    computed = 0
    for _ in range(MAX_OUTPUT):
        live = [i for i in range(SEEDS) if i not in done]
        if not live:
            break
        inputs = [StepInput(rows[i].token_ids[computed:], computed, tables[i]) for i in live]
        sampled = engine.step(inputs, [rows[i] for i in live])
        computed = len(rows[live[0]].token_ids)
        for i, token in zip(live, sampled.tokens):
            rows[i].token_ids.append(token)  # type: ignore[attr-defined]
            if token == EOS:
                done[i] = list(rows[i].token_ids[len(prompt) : -1])
                engine.release(rows[i].request_id)
    assert len(done) == SEEDS, f"{SEEDS - len(done)} outputs did not end within {MAX_OUTPUT} tokens"
    return [done[i] for i in range(SEEDS)]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_output_matches_its_spec(engine: Engine, mode: str) -> None:
    spec, check = MODES[mode]
    for output in generate(engine, spec):
        check(bytes(output).decode("utf-8"))
