"""KV-cache events: vLLM's block hashes and wire format (checked against values vLLM's own code
computed), the --kv-events-config checks, the publisher and its replay socket, and the block
manager's events mirroring its cache."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import msgspec
import pytest
import zmq

import engine.block_manager as bm_module
from engine.block_manager import BlockManager
from engine.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventsConfig,
    KVEventsError,
    offset_endpoint,
    removed,
    stored,
)

REFERENCE = json.loads((Path(__file__).parent / "data" / "vllm_kv_reference.json").read_text())


@pytest.mark.parametrize(
    "chain", REFERENCE["chains"], ids=lambda c: f"{c['algo']}-seed{c['seed']}-bs{c['block_size']}"
)
def test_block_hashes_are_vllms(chain: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    if chain["algo"] == "sha256_cbor":
        pytest.importorskip("cbor2", reason="sha256_cbor needs cbor2 (in the test extra)")
    if chain["seed"] is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", chain["seed"])
    hasher = BlockHasher(chain["algo"])
    hashes = hasher.chain(REFERENCE["token_ids"], chain["block_size"])
    assert [h.hex() for h in hashes] == chain["hashes"]
    assert [hasher.external(h) for h in hashes] == chain["external"]


def test_event_batch_is_vllms() -> None:
    tokens = REFERENCE["token_ids"]
    batch = KVEventBatch(
        1700000000.5,
        [
            stored([11, 12], None, tokens[:8], 4),
            stored([13], 12, tokens[8:12], 4),
            removed([13, 12]),
            AllBlocksCleared(),
        ],
        1,
    )
    theirs = bytes.fromhex(REFERENCE["batch_msgpack"])
    # The same msgpack values (vLLM's structs have more fields, so msgspec gives their maps a longer
    # header).
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(batch)) == msgspec.msgpack.decode(theirs)
    assert msgspec.msgpack.Decoder(KVEventBatch).decode(theirs) == batch


def test_bytes_hashes_when_vllm_env_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    hasher = BlockHasher()
    h = hasher.block(None, (1, 2, 3))
    assert hasher.external(h) == h and len(h) == 32


def test_config_parses_vllms_json_and_names_mistakes() -> None:
    cfg = KVEventsConfig.parse(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}'
    )
    assert (
        cfg.publishing
        and cfg.endpoint == "tcp://*:6000"
        and cfg.topic == "kv"
        and cfg.buffer_steps == 10_000
    )
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": false}').publishing
    assert not KVEventsConfig.parse(
        '{"enable_kv_cache_events": true, "publisher": "null"}'
    ).publishing
    for text, needle in [
        ("{", "not JSON"),
        ("[]", "JSON object"),
        ('{"endpont": "x"}', "unknown key(s) endpont"),
        ('{"hwm": "10"}', 'hwm must be an integer, not "10"'),
        ('{"enable_kv_cache_events": 1}', "must be true or false"),
        ('{"publisher": "kafka"}', "kafka"),
        ('{"buffer_steps": 0}', "at least 1"),
        ('{"endpoint": "tcp://*"}', "needs a port"),
        ('{"endpoint": "udp://x:1"}', "tcp://"),
    ]:
        with pytest.raises(KVEventsError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            KVEventsConfig.parse(text)
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"


def test_unknown_hash_algo_is_refused() -> None:
    with pytest.raises(KVEventsError, match="sha256_cbor"):
        BlockHasher("md5")


def subscribed(publisher: KVEventPublisher, sub: zmq.Socket, timeout: float = 10.0) -> int:
    """Publish empty batches until sub receives the latest one sent: its subscription has reached
    the PUB socket (which drops what it sends before) and nothing sent so far is still on its
    way. Returns the batches sent."""
    sent = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        publisher.publish([])
        sent += 1
        while sub.poll(100):
            if int.from_bytes(sub.recv_multipart()[1], "big") == sent - 1:
                return sent
    raise AssertionError(f"the subscriber received none of {sent} batches in {timeout} s")


def test_publisher_numbers_batches_and_replays_them(tmp_path: Path) -> None:
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        buffer_steps=2,
        topic="kv",
    )
    ctx = zmq.Context()
    publisher = KVEventPublisher(cfg, rank=1, ctx=ctx)
    assert publisher.endpoint == f"ipc://{tmp_path}/pub_dp1"
    sub = ctx.socket(zmq.SUB)
    sub.connect(publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    try:
        n = subscribed(publisher, sub)
        for i in range(3):
            publisher.publish([removed([i])])
        got = []
        for _ in range(3):
            assert sub.poll(5000), "no batch arrived"
            topic, seq, payload = sub.recv_multipart()
            batch = decode(payload)
            assert topic == b"kv" and batch.data_parallel_rank == 1
            got.append((int.from_bytes(seq, "big"), batch.events[0].block_hashes))
        assert got == [(n, [0]), (n + 1, [1]), (n + 2, [2])]
        replay = ctx.socket(zmq.DEALER)
        replay.connect(publisher.replay_endpoint)
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        while True:
            assert replay.poll(5000), "the replay socket did not answer"
            _, seq, payload = replay.recv_multipart()
            if seq == END_SEQ:
                break
            frames.append((int.from_bytes(seq, "big"), decode(payload).events[0].block_hashes))
        assert frames == [(n + 1, [1]), (n + 2, [2])]  # only the last buffer_steps batches are kept
        replay.close(0)
    finally:
        sub.close(0)
        publisher.close()
        ctx.term()


def test_a_dropped_batch_leaves_a_gap_in_the_numbers(tmp_path: Path) -> None:
    """A full queue drops a batch; its sequence number stays unused, so a subscriber knows it missed
    one."""
    cfg = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub", max_queue_size=1
    )
    ctx = zmq.Context()
    publisher = KVEventPublisher(cfg, ctx=ctx)
    sub = ctx.socket(zmq.SUB)
    sub.connect(publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")

    def received() -> int:
        assert sub.poll(5000), "a batch the publisher queued did not arrive"
        return int.from_bytes(sub.recv_multipart()[1], "big")

    try:
        n, before = subscribed(publisher, sub), publisher.dropped
        publisher._wake.wait = lambda timeout=None: time.sleep(
            0.2
        )  # the thread lags: the queue fills
        for i in range(4):
            publisher.publish([removed([i])])
        dropped = publisher.dropped - before
        assert dropped >= 1
        sent = [
            received() for _ in range(4 - dropped)
        ]  # the queue is empty once the last of them arrived
        publisher.publish([removed([9])])  # the next batch after the drop
        assert received() == n + 4 and not sub.poll(0)
        # The dropped batches' numbers are missing: the gaps say how many.
        assert sent == sorted(sent) and len(set(range(n, n + 4)) - set(sent)) == dropped
    finally:
        sub.close(0)
        publisher.close()
        ctx.term()


class Subscriber:
    """What a router learns from the events: each block hash it holds, with the whole token prefix
    it stands for."""

    def __init__(self, hasher: BlockHasher, block_size: int, strict: bool = True) -> None:
        self.hasher, self.bs, self.strict = hasher, block_size, strict
        self.prefix: dict[int, tuple[int, ...]] = {}
        self.by_hash: dict[int, bytes] = {}  # external -> full hash, to recompute the chain

    def apply(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        if isinstance(event, AllBlocksCleared):
            self.prefix.clear()
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                assert h in self.prefix, "removed a block it never stored"
                del self.prefix[h]
        else:
            assert event.block_size == self.bs and event.medium == "GPU" and event.lora_id is None
            assert len(event.token_ids) == self.bs * len(event.block_hashes)
            parent = None
            prefix: tuple[int, ...] = ()
            if event.parent_block_hash is not None:
                if (
                    event.parent_block_hash not in self.prefix
                    or None in self.prefix[event.parent_block_hash]
                ):
                    # Only where the block manager's own hash collided within one sequence (the
                    # weak-hash test) can a block be stored after its parent was dropped.
                    assert not self.strict, "a stored block's parent is unknown"
                    for h in event.block_hashes:
                        self.prefix[h] = (
                            None,
                        ) * self.bs  # known to be held; its prefix cannot be checked
                    return
                parent, prefix = (
                    self.by_hash[event.parent_block_hash],
                    self.prefix[event.parent_block_hash],
                )
            for i, h in enumerate(event.block_hashes):
                block = tuple(event.token_ids[i * self.bs : (i + 1) * self.bs])
                parent = self.hasher.block(parent, block)
                assert self.hasher.external(parent) == h, "not vLLM's chained hash of the prefix"
                prefix += block
                assert h not in self.prefix, "stored twice without a removal between"
                self.prefix[h], self.by_hash[h] = prefix, parent


@pytest.mark.parametrize("weak_hash", [False, True], ids=["hash", "colliding-hash"])
def test_events_mirror_the_cache(weak_hash: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random conversations through a small pool: after every operation, the blocks a subscriber
    holds are exactly the cached blocks, each hash is vLLM's for its whole prefix, and the prefix
    is the block's real one."""
    if weak_hash:  # collisions in the block manager's own hash must not leak into vLLM's
        monkeypatch.setattr(bm_module, "chain_hash", lambda parent, block: hash(block) % 7)
    bs, rng = 4, random.Random(1)
    hasher = BlockHasher()
    bm = BlockManager(num_blocks=40, block_size=bs, hasher=hasher)
    view = Subscriber(hasher, bs, strict=not weak_hash)
    histories: list[list[int]] = []
    live: list[str] = []
    for step in range(800):
        if live and rng.random() < 0.4:
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            base = rng.choice(histories) if histories and rng.random() < 0.6 else []
            tokens = base[: rng.randrange(len(base) + 1)] + [
                rng.randrange(30) for _ in range(rng.randrange(1, 12))
            ]
            cached = bm.allocate(f"s{step}", tokens, num_extra_slots=rng.randrange(4))
            if cached is not None:
                bm.cache_blocks(f"s{step}", tokens, len(tokens))
                live.append(f"s{step}")
                histories.append(tokens)
        for event in bm.take_events():
            view.apply(event)
        cached_blocks = {hasher.external(b.ext): b for b in bm._blocks if b.hash is not None}
        assert set(view.prefix) == set(cached_blocks)
        for h, block in cached_blocks.items():
            assert view.prefix[h][-bs:] in (block.token_ids, (None,) * bs)
