"""KV-cache events in vLLM's format: block hashes as vLLM computes them, the event structs, the
ZeroMQ publisher.

A router that places requests by where their KV blocks are (vllm-router's
kv_aware, llm-d's precise prefix scorer, Dynamo) subscribes to each node's
events. To it our node must look like vLLM 0.33: the same `--kv-events-config`
JSON, the same wire format (an array-like EventBatch of tagged-map events,
msgpack, sent as [topic, 8-byte big-endian sequence number, payload] on a PUB
socket, with the replay ROUTER socket answering "from sequence n"), and the
same block hashes for the same token ids and block size, so a consumer that
recomputes them (or compares them across vLLM and ppd nodes) agrees.

The hashes are vLLM's `hash_block_tokens`: sha256 over pickle (vLLM's default)
or canonical CBOR of (parent hash, block token ids, extra keys), chained from
NONE_HASH = hash(seed), the seed being $PYTHONHASHSEED or "vllm-none-hash";
events carry their low 64 bits as an int unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.
They are computed only when events are on: the block manager's own chain hash
(engine/prefix_hash.py) stays what prefix matching uses.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import msgspec
import zmq

log = logging.getLogger("ppd.kv_events")

HASH_ALGOS = ("sha256", "sha256_cbor")
DEFAULT_NONE_HASH_SEED = (
    "vllm-none-hash"  # vLLM's seed for cryptographic hashes when PYTHONHASHSEED is unset
)
MEDIUM_GPU = (
    "GPU"  # vLLM's medium for the device cache, whatever the device: consumers filter on it
)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end-of-replay marker

ExternalBlockHash = bytes | int


# ---- hashes --------------------------------------------------------------------------------------


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    try:
        import cbor2
    except ImportError as exc:  # an optional dependency, as in vLLM
        raise KVEventsError(
            "--prefix-caching-hash-algo sha256_cbor needs cbor2: pip install cbor2"
        ) from exc
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


class BlockHasher:
    """vLLM's chained block hash (`hash_block_tokens`) with its NONE_HASH seed, and the form events
    carry."""

    def __init__(
        self, algo: str = "sha256", seed: str | None = None, int_hashes: bool | None = None
    ) -> None:
        if algo not in HASH_ALGOS:
            raise KVEventsError(
                f"unknown --prefix-caching-hash-algo {algo!r}; choose one of "
                f"{', '.join(HASH_ALGOS)}"
            )
        self.algo = algo
        self._fn: Callable[[Any], bytes] = _sha256_pickle if algo == "sha256" else _sha256_cbor
        if seed is None:
            seed = os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
        self.none_hash = self._fn(seed)
        if int_hashes is None:
            int_hashes = bool(int(os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")))
        self.int_hashes = int_hashes

    def block(self, parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
        """The hash of a full block given its parent's (None for a sequence's first block); no extra
        keys."""
        return self._fn((parent or self.none_hash, token_ids, None))

    def chain(self, token_ids: list[int], block_size: int) -> list[bytes]:
        """One hash per full block of token_ids, chained from the start (vLLM's request block
        hasher)."""
        hashes: list[bytes] = []
        parent = None
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            parent = self.block(parent, tuple(token_ids[start : start + block_size]))
            hashes.append(parent)
        return hashes

    def external(self, block_hash: bytes) -> ExternalBlockHash:
        """What an event carries (vLLM's maybe_convert_block_hash): the low 64 bits as an int, or
        the bytes."""
        return (
            int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF
            if self.int_hashes
            else block_hash
        )


# ---- the events (vllm/distributed/kv_events.py, field for field) ---------------------------------


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event is a map tagged with "type": its class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: (
        ExternalBlockHash | None
    )  # the block before the first one here; None: they start a sequence
    token_ids: list[int]  # every block's tokens, in order
    block_size: int
    # No defaults, as in vLLM: omit_defaults would drop a field equal to its default, and consumers
    # require these.
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def stored(
    hashes: list[ExternalBlockHash],
    parent: ExternalBlockHash | None,
    token_ids: list[int],
    block_size: int,
) -> BlockStored:
    """Blocks of one sequence cached, as vLLM reports them (no LoRA, the device cache, KV cache
    group 0)."""
    return BlockStored(hashes, parent, token_ids, block_size, None, MEDIUM_GPU, None, group_idx=0)


def removed(hashes: list[ExternalBlockHash]) -> BlockRemoved:
    """Cached blocks evicted (or dropped), as vLLM reports them."""
    return BlockRemoved(hashes, MEDIUM_GPU, group_idx=0)


# ---- configuration (vLLM's KVEventsConfig, as --kv-events-config JSON) ---------------------------


class KVEventsError(ValueError):
    """A --kv-events-config or hash setting that cannot work; the message names the fix."""


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; default: zmq when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishing(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """From the --kv-events-config JSON, with an error naming any problem."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KVEventsError(
                f"--kv-events-config is not JSON ({exc}); e.g. "
                '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\''
            ) from None
        if not isinstance(raw, dict):
            raise KVEventsError("--kv-events-config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        if unknown := sorted(set(raw) - set(known)):
            raise KVEventsError(
                f"--kv-events-config: unknown key(s) {', '.join(unknown)}; known: "
                f"{', '.join(known)}"
            )
        kinds = {
            "enable_kv_cache_events": bool,
            "buffer_steps": int,
            "hwm": int,
            "max_queue_size": int,
        }
        words = {bool: "true or false", int: "an integer", str: "a string"}
        for key, value in raw.items():
            want = kinds.get(key, str)
            ok = (isinstance(value, want) and (want is bool or not isinstance(value, bool))) or (
                value is None and key in ("publisher", "replay_endpoint")
            )
            if not ok:
                raise KVEventsError(
                    f"--kv-events-config: {key} must be {words[want]}, not {json.dumps(value)}"
                )
        cfg = cls(**raw)
        if cfg.publisher not in (None, "zmq", "null"):
            raise KVEventsError(
                f"--kv-events-config: publisher {cfg.publisher!r} is not one of zmq, null"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(cfg, name) < 1:
                raise KVEventsError(f"--kv-events-config: {name} must be at least 1")
        for endpoint in (cfg.endpoint, cfg.replay_endpoint):
            if endpoint is not None:
                offset_endpoint(endpoint, 0)
        return cfg


def offset_endpoint(endpoint: str, rank: int) -> str:
    """Unit `rank`'s endpoint, as vLLM offsets a data-parallel rank's: tcp port + rank, or an
    ipc/inproc suffix."""
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if not sep or not host or not port.isdigit():
            raise KVEventsError(
                f"--kv-events-config: endpoint {endpoint!r} needs a port, e.g. tcp://*:5557"
            )
        return f"tcp://{host}:{int(port) + rank}" if rank else endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}" if rank else endpoint
    raise KVEventsError(
        f"--kv-events-config: endpoint {endpoint!r} must start with tcp://, ipc:// or inproc://"
    )


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ipc or inproc endpoint; connect to a named host (a
    broker's)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# ---- the publisher -------------------------------------------------------------------------------


class KVEventPublisher:
    """Sends event batches on a PUB socket from a thread, keeping the last buffer_steps for the
    replay socket.

    publish() numbers the batch and queues it (the decode worker's step loop must not wait on a
    subscriber); the thread encodes and sends it. A full queue drops the batch (where vLLM's bounded
    queue would block the scheduler), its number unused: a subscriber sees the gap and knows its
    view of the cache is incomplete.
    """

    def __init__(self, cfg: KVEventsConfig, rank: int = 0, ctx: zmq.Context | None = None) -> None:
        self.rank = rank
        self._ctx = ctx or zmq.Context.instance()
        self._topic = cfg.topic.encode()
        self._queue: deque[tuple[int, KVEventBatch] | None] = deque()
        self._next_seq = 0
        self._max_queue = cfg.max_queue_size
        self._wake = threading.Event()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self.dropped = 0
        self.endpoint = offset_endpoint(cfg.endpoint, rank)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._pub.linger = 0
        if _binds(self.endpoint):
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        self.replay_endpoint = (
            offset_endpoint(cfg.replay_endpoint, rank) if cfg.replay_endpoint else None
        )
        self._replay = None
        if self.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.linger = 0
            self._replay.bind(self.replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        if len(self._queue) >= self._max_queue:
            if self.dropped == 0:
                log.warning(
                    "kv events: the queue is full (%d batches): dropping batches until it drains",
                    self._max_queue,
                )
            self.dropped += 1
            return
        self._queue.append((seq, KVEventBatch(time.time(), events, self.rank)))
        self._wake.set()

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to timeout seconds), then close the sockets."""
        self._queue.append(None)
        self._wake.set()
        self._thread.join(timeout)
        self._pub.close()
        if self._replay is not None:
            self._replay.close()

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        while True:
            # The replay socket is checked every 50 ms, or at once when batches are queued.
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            self._wake.wait(0.05 if self._replay is not None else None)
            self._wake.clear()
            while self._queue:
                item = self._queue.popleft()
                if item is None:
                    return
                seq, batch = item
                try:
                    payload = encode(batch)
                    self._pub.send_multipart(
                        (self._topic, seq.to_bytes(8, "big"), payload), copy=False
                    )
                except (
                    zmq.ZMQError,
                    TypeError,
                    ValueError,
                ) as exc:  # one batch lost, not the publisher
                    log.error("kv events: batch %d not sent: %s", seq, exc)
                    continue
                self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                log.warning(
                    "kv events: a replay request of %d frames (want identity, empty, start "
                    "sequence)",
                    len(frames),
                )
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))


def describe(cfg: KVEventsConfig, units: int) -> str:
    """Where each unit publishes, for the startup log and the router's --kv-event-source."""
    pubs = ", ".join(offset_endpoint(cfg.endpoint, u) for u in range(units))
    text = f"KV events on {pubs}"
    if cfg.replay_endpoint:
        text += (
            f" (replay: {', '.join(offset_endpoint(cfg.replay_endpoint, u) for u in range(units))})"
        )
    return text
