"""The engine object: a device's start-up (create, attach), and greedy output equal to transformers
on every path the GPU adds (Triton kernels, CUDA graphs for decode and for prefill, append and
mixed steps, split-KV, padding)."""

from __future__ import annotations

import os
import random
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
import torch

from engine.engine import MAX_FAILED_STEPS, Engine, EngineConfig
from engine.guided import GuidedError
from engine.model_runner import PromptLogprobsAsk, StepInput
from engine.sampler import Row
from engine.sampling_params import GuidedSpec, SamplingParams
from engine.shared_memory import release_name
from tests.tiny_models import ARCHS, MOE_ARCHS, hf_greedy, hf_logits, write_tiny_model

GREEDY = SamplingParams(temperature=0.0)
NEW_TOKENS = 10


def random_ids(n: int, seed: int, vocab_size: int = 320) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(n)]


class Conversation:
    """One sequence driven through an engine: its tokens and its block table (blocks handed out from
    a shuffled list)."""

    def __init__(self, engine: Engine, free: list[int], prompt: list[int]) -> None:
        self.engine, self.free, self.tokens, self.cached, self.table = (
            engine,
            free,
            list(prompt),
            0,
            [],
        )

    def next_input(self) -> StepInput:
        end = len(self.tokens)
        while len(self.table) * self.engine.plan.block_size < end + 1:
            self.table.append(self.free.pop())
        inp = StepInput(self.tokens[self.cached : end], self.cached, list(self.table))
        self.cached = end
        return inp


def run_together(engine: Engine, convs: list[Conversation], steps: int) -> None:
    """steps forward passes over all conversations at once; each appends its greedy token."""
    for _ in range(steps):
        inputs = [c.next_input() for c in convs]
        tokens = engine.step(inputs, [Row(GREEDY)] * len(convs)).tokens
        for c, t in zip(convs, tokens):
            c.tokens.append(t)


def run_ahead(engine: Engine, convs: list[Conversation], steps: int) -> None:
    """run_together with async scheduling: each step after the first is launched before the one
    before is taken, its inputs' tokens taken on the device from that step's samples
    (StepInput.previous)."""
    in_flight = None
    for step in range(steps):
        inputs = [c.next_input() for c in convs]
        # every conversation's new token is the one the step in flight samples, in conversation
        # order
        if step:
            inputs = [replace(inp, token_ids=[0], previous=k) for k, inp in enumerate(inputs)]
        launched = engine.launch(inputs, [Row(GREEDY)] * len(convs), in_flight)
        if in_flight is not None:
            for c, t in zip(convs, in_flight.result().tokens):
                c.tokens[-1] = t
        for c in convs:
            c.tokens.append(-1)  # the step's token, not on the host yet
        in_flight = launched
    for c, t in zip(convs, in_flight.result().tokens):
        c.tokens[-1] = t


def free_blocks(engine: Engine, seed: int = 0) -> list[int]:
    free = list(range(engine.num_kv_blocks))
    random.Random(seed).shuffle(free)  # tables are never contiguous
    return free


def names(tag: str) -> tuple[str, str]:
    return f"ppd-test-{os.getpid()}-{tag}-weights", f"ppd-test-{os.getpid()}-{tag}-kv"


def test_cpu_engine_and_an_attached_peer_share_memory_and_agree(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "llama", "llama")
    cfg = EngineConfig(
        model=str(folder), num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=64
    )
    owner = Engine.create(cfg, names("cpu"))
    peer = Engine.attach(
        cfg, owner.weights_handle, owner.kv_handle, owner.num_kv_blocks, owner.max_model_len
    )
    try:
        assert owner.plan.num_blocks == 32 and peer.max_model_len == owner.max_model_len
        prompt = random_ids(21, seed=1)
        # The peer prefills (writing KV into the shared pool), the owner decodes on top of that KV.
        conv = Conversation(owner, free_blocks(owner), prompt)
        conv.tokens.append(peer.step([conv.next_input()], [Row(GREEDY)]).tokens[0])
        run_together(owner, [conv], NEW_TOKENS - 1)
        assert conv.tokens[len(prompt) :] == hf_greedy(folder, prompt, NEW_TOKENS)
    finally:
        release_name(owner.weights_handle)
        release_name(owner.kv_handle)


def test_a_failing_input_ends_alone_and_the_others_match_hf(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "llama", "llama")
    cfg = EngineConfig(
        model=str(folder), num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=64
    )
    engine = Engine.create(cfg, names("fail"))
    try:
        prompts = [random_ids(9, seed=2), random_ids(13, seed=3)]
        free = free_blocks(engine)
        convs = [Conversation(engine, free, p) for p in prompts]
        run = engine.runner.run

        def poisoned(
            inputs: list[StepInput], previous=None
        ):  # a fault only the second conversation's inputs trigger
            if any(i.block_table == convs[1].table for i in inputs):
                raise ValueError("poisoned input")
            return run(inputs, previous)

        engine.runner.run = poisoned
        sampled, failed = engine.step_each([c.next_input() for c in convs], [Row(GREEDY)] * 2)
        tokens = sampled.tokens
        assert (
            failed == {1: "ValueError: poisoned input"}
            and tokens[1] is None
            and failed[1].status == 500
        )
        convs[0].tokens.append(tokens[0])
        run_together(engine, convs[:1], NEW_TOKENS - 1)
        assert convs[0].tokens[len(prompts[0]) :] == hf_greedy(folder, prompts[0], NEW_TOKENS)
        # Steps in which every input fails for a reason of its own request (a grammar the output
        # left) say nothing of the engine: it goes on.
        engine.runner.run = lambda inputs, previous=None: (_ for _ in ()).throw(
            GuidedError("output left the grammar")
        )
        inp = convs[0].next_input()
        for _ in range(MAX_FAILED_STEPS + 1):
            assert engine.step_each([inp], [Row(GREEDY)])[1] == {
                0: "GuidedError: output left the grammar"
            }
        # An engine on which everything fails is broken: after a few such steps it gives up (the
        # worker restarts).
        engine.runner.run = lambda inputs, previous=None: (_ for _ in ()).throw(
            RuntimeError("device lost")
        )
        for _ in range(2):
            assert engine.step_each([inp], [Row(GREEDY)])[1] == {0: "RuntimeError: device lost"}
        with pytest.raises(RuntimeError, match="steps in a row failed"):
            engine.step_each([inp], [Row(GREEDY)])
    finally:
        release_name(engine.weights_handle)
        release_name(engine.kv_handle)


def test_a_guided_request_on_an_engine_without_a_tokenizer_ends_alone_naming_the_fix(
    tmp_path: Path,
) -> None:
    """A worker without a tokenizer (--skip-tokenizer-init) that is sent a guided request anyway
    (the API server refuses it first; a worker never trusts a message) takes it without raising,
    and its first step ends it alone with an error that says what to do; the other request of the
    step gets its token."""
    folder = write_tiny_model(tmp_path / "llama", "llama")
    cfg = EngineConfig(
        model=str(folder), num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=64
    )
    engine = Engine.create(cfg, names("guided"))
    try:
        guided = msgspec.structs.replace(GREEDY, guided=GuidedSpec("regex", "[0-9]+"))
        engine.prepare("g", guided)
        free = free_blocks(engine)
        convs = [Conversation(engine, free, random_ids(n, seed=n)) for n in (6, 9)]
        rows = [
            Row(guided, convs[0].tokens, len(convs[0].tokens), "g"),
            Row(GREEDY, convs[1].tokens, len(convs[1].tokens), "plain"),
        ]
        sampled, failed = engine.step_each([c.next_input() for c in convs], rows)
        assert list(failed) == [0] and failed[0].startswith("GuidedError: request g: ")
        assert "need a tokenizer" in failed[0] and "start the server with a tokenizer" in failed[0]
        assert (
            failed[0].status == 400
        )  # the request's own reason: the client is answered 400, not 500
        assert (
            sampled.tokens[0] is None
            and sampled.tokens[1] == hf_greedy(folder, convs[1].tokens, 1)[0]
        )
    finally:
        release_name(engine.weights_handle)
        release_name(engine.kv_handle)


def test_a_failed_step_is_waited_for_before_the_next_step_and_the_return(tmp_path: Path) -> None:
    """A step may raise after it launched device work (a grammar fails after the forward pass):
    step_each waits for that work before it runs anything else or hands the failures back (which
    frees the failed inputs' blocks)."""
    folder = write_tiny_model(tmp_path / "llama", "llama")
    cfg = EngineConfig(
        model=str(folder), num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=64
    )
    engine = Engine.create(cfg, names("wait"))
    try:
        free = free_blocks(engine)
        convs = [Conversation(engine, free, random_ids(n, seed=n)) for n in (5, 8)]
        events: list[str] = []
        run = engine.runner.run

        def launched_then_failed(inputs: list[StepInput], previous=None):
            events.append(f"run {len(inputs)}")
            result = run(inputs, previous)
            if any(i.block_table == convs[1].table for i in inputs):
                raise GuidedError("output left the grammar")
            return result

        engine.runner.run = launched_then_failed
        engine._wait_for_device = lambda: events.append("wait")
        _, failed = engine.step_each([c.next_input() for c in convs], [Row(GREEDY)] * 2)
        assert list(failed) == [1]
        assert events == ["run 2", "wait", "run 1", "run 1", "wait"]
    finally:
        release_name(engine.weights_handle)
        release_name(engine.kv_handle)


def check_prompt_logprobs_beside_decodes(engine: Engine, folder: Path) -> None:
    """A prompt in two chunks that ask for prompt logprobs, each in a step beside decoding
    conversations (with more asked rows than the engine's slice of max_num_seqs rows): the logprobs
    equal transformers' log-softmax, and the decodes are undisturbed."""
    free = free_blocks(engine)
    decoding = [Conversation(engine, free, random_ids(n, seed=n)) for n in (6, 11)]
    run_together(engine, decoding, 1)
    prompt = random_ids(30, seed=7)
    table = [free.pop() for _ in range(-(-31 // engine.plan.block_size))]
    got = []
    for start, end in ((0, 17), (17, 30)):
        ask = PromptLogprobsAsk.for_chunk(3, prompt, len(prompt), start, end)
        chunk = StepInput(prompt[start:end], start, table, sample=end == 30, prompt_logprobs=ask)
        inputs = [*(c.next_input() for c in decoding), chunk]
        sampled = engine.step(inputs, [Row(GREEDY)] * (2 + chunk.sample))
        got += sampled.prompt_logprobs[2]
        for c, t in zip(decoding, sampled.tokens):
            c.tokens.append(t)
    ref = hf_logits(folder, prompt)[:-1].log_softmax(-1)
    assert len(got) == len(prompt) - 1
    for i, lp in enumerate(got):
        assert lp.logprob == pytest.approx(float(ref[i, prompt[i + 1]]), abs=1e-4)
        assert lp.top_logprobs == pytest.approx(ref[i].topk(3).values.tolist(), abs=1e-4)
        assert lp.top_ids[0] == int(ref[i].argmax())
    for c in decoding:
        prompt_len = len(c.tokens) - 3
        assert c.tokens[prompt_len:] == hf_greedy(folder, c.tokens[:prompt_len], 3)


def test_prompt_logprobs_in_slices_beside_decodes_match_hf(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "llama", "llama")
    cfg = EngineConfig(
        model=str(folder), num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=64
    )
    engine = Engine.create(cfg, names("plp"))
    try:
        check_prompt_logprobs_beside_decodes(engine, folder)
    finally:
        release_name(engine.weights_handle)
        release_name(engine.kv_handle)


def check_run_ahead(engine: Engine, folder: Path) -> None:
    """Steps launched ahead of the one before give the greedy ids of steps run one by one: decodes,
    then a turn's append-prefill beside the others' decodes (its chunk's last token sampled, then
    taken on the device)."""
    free = free_blocks(engine)
    prompts = [random_ids(n, seed=s) for n, s in ((23, 1), (40, 2), (7, 3))]
    convs = [Conversation(engine, free, p) for p in prompts]
    run_ahead(engine, convs, NEW_TOKENS)
    for conv, prompt in zip(convs, prompts):
        assert conv.tokens[len(prompt) :] == hf_greedy(folder, prompt, NEW_TOKENS)
    first = convs[0]
    first.tokens += random_ids(19, seed=4)
    turn2 = list(first.tokens)
    run_ahead(engine, convs, NEW_TOKENS)
    assert first.tokens[len(turn2) :] == hf_greedy(folder, turn2, NEW_TOKENS)


def test_steps_launched_ahead_take_their_tokens_on_the_device_and_match_hf(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "llama", "llama")
    cfg = EngineConfig(
        model=str(folder), num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=64
    )
    engine = Engine.create(cfg, names("ahead"))
    try:
        check_run_ahead(engine, folder)
    finally:
        release_name(engine.weights_handle)
        release_name(engine.kv_handle)


# ---- on a GPU: the Triton backend and CUDA graphs against transformers (float32) -----------------


@pytest.fixture(scope="module", params=ARCHS + MOE_ARCHS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def cuda_engine(folder: Path, eager: bool, block_size: int = 16) -> Engine:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cfg = EngineConfig(
        model=str(folder),
        dtype="float32",
        device="cuda",
        block_size=block_size,
        num_kv_blocks=256,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enforce_eager=eager,
    )
    return Engine.create(cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_turns_and_mixed_batches_match_hf(tiny: Path, eager: bool) -> None:
    engine = cuda_engine(tiny, eager)
    assert engine.runner.backend.name == "triton"
    assert (engine.runner.graphs is None) == eager
    replayed = []
    if (
        not eager
    ):  # which buckets the steps replay: prompts, then decodes, then an append beside decodes
        graphs = engine.runner.graphs
        replay = graphs.run
        graphs.run = lambda batch, bucket: (replayed.append(bucket), replay(batch, bucket))[1]
    free = free_blocks(engine)
    # Three conversations decode together: a batch of 3 replays the graph of 4 with one padding row.
    prompts = [random_ids(n, seed=s) for n, s in ((23, 1), (40, 2), (7, 3))]
    convs = [Conversation(engine, free, p) for p in prompts]
    run_together(engine, convs, NEW_TOKENS)
    for conv, prompt in zip(convs, prompts):
        assert conv.tokens[len(prompt) :] == hf_greedy(tiny, prompt, NEW_TOKENS)
    # Turn 2 of the first conversation (an append-prefill over its cached KV) mixed with the others'
    # decodes.
    first = convs[0]
    first.tokens += random_ids(19, seed=4)
    turn2 = list(first.tokens)
    run_together(engine, convs, NEW_TOKENS)
    assert first.tokens[len(turn2) :] == hf_greedy(tiny, turn2, NEW_TOKENS)
    for conv, prompt in zip(convs[1:], prompts[1:]):
        assert conv.tokens[len(prompt) :] == hf_greedy(tiny, prompt, 2 * NEW_TOKENS)
    if not eager:
        # The prompts' step (70 tokens), every decode step, and the append beside two decodes (22
        # tokens).
        assert [(b.tokens, b.decode) for b in replayed] == (
            [(96, False)]
            + [(4, True)] * (NEW_TOKENS - 1)
            + [(32, False)]
            + [(4, True)] * (NEW_TOKENS - 1)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_steps_launched_ahead_match_hf(tiny: Path, eager: bool) -> None:
    check_run_ahead(cuda_engine(tiny, eager), tiny)


@pytest.mark.gpu
def test_cuda_prompt_logprobs_beside_decodes_match_hf(tiny: Path) -> None:
    check_prompt_logprobs_beside_decodes(cuda_engine(tiny, eager=False), tiny)


@pytest.mark.gpu
def test_cuda_long_context_decode_with_split_kv_matches_hf(tmp_path: Path) -> None:
    # Long enough that an eager decode step splits the sequence's KV across programs.
    folder = write_tiny_model(tmp_path / "llama", "llama", max_position_embeddings=1024)
    engine = cuda_engine(folder, eager=True, block_size=4)
    prompt = random_ids(600, seed=5)
    conv = Conversation(engine, free_blocks(engine), prompt)
    run_together(engine, [conv], 1)
    decode = engine.runner.make_batch([StepInput([1], len(prompt), conv.table)])
    assert engine.runner.backend.prepare(decode).num_splits > 1
    run_together(engine, [conv], NEW_TOKENS - 1)
    assert conv.tokens[len(prompt) :] == hf_greedy(folder, prompt, NEW_TOKENS)


@pytest.mark.gpu
def test_cuda_pool_is_sized_from_free_memory(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    folder = write_tiny_model(tmp_path / "llama", "llama")
    cfg = EngineConfig(
        model=str(folder),
        dtype="float32",
        device="cuda",
        gpu_memory_utilization=0.2,
        max_num_seqs=8,
        max_num_batched_tokens=256,
    )
    engine = Engine.create(cfg)
    free, total = torch.cuda.mem_get_info()
    pool = engine.runner.kv_pool
    pool_bytes = pool.numel() * pool.element_size()
    # The pool took most of what 20% of the device allowed, and the device still has the rest.
    assert 0.1 * total < pool_bytes < 0.2 * total and free > 0.7 * total
    assert "GiB allowed" in engine.plan.summary


RACE_SCRIPT = """
import sys, torch
from engine.engine import Engine, EngineConfig
cfg = EngineConfig(model=sys.argv[1], dtype="float32", device="cuda", gpu_memory_utilization=0.05,
                   max_num_seqs=8, max_num_batched_tokens=256, enforce_eager=True)
engine = Engine.create(cfg)
pool = engine.runner.kv_pool
before = pool.double().abs().sum().item()
# Leave small blocks full of huge indices in torch's cache, where the graphs' static buffers will be
# allocated, and keep the current stream busy for about a second, so that those buffers' fills run
# late.
junk = [torch.full((65536,), 2**40, dtype=torch.int64, device="cuda") for _ in range(256)]
del junk
torch.cuda._sleep(2_000_000_000)
engine.runner.capture_graphs(cfg.max_num_seqs)
torch.cuda.synchronize()
assert pool.double().abs().sum().item() == before, "capturing the graphs wrote into the KV pool"
print("ok")
"""


@pytest.mark.gpu
def test_cuda_graph_capture_waits_for_its_buffers_to_be_filled(tmp_path: Path) -> None:
    """Capture's warm-up steps run on a side stream: they must wait for the static buffers' fills on
    the current stream, or the padding rows' slot mapping (-1: write nothing) is whatever the
    allocator's cache held, and the warm-up stores KV anywhere (an illegal address, seen on an H200
    when an earlier test had left such blocks). In a child process, since an illegal address poisons
    the process's CUDA context for every later test."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import subprocess
    import sys

    folder = write_tiny_model(tmp_path / "llama", "llama")
    proc = subprocess.run(
        [sys.executable, "-c", RACE_SCRIPT, str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
