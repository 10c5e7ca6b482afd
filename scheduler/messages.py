"""Every message that crosses a process boundary, in one place.

    API server --GenerateRequest/AbortRequest--> decode worker
    API server 0 --AbortPrefix--> decode worker (another API server died)
    decode worker --UnitSetup/PrefillJob/AbortPrefill--> prefill worker
    prefill worker --PrefillReady/PrefillDone--> decode worker
    both workers --WorkerOutput--> API server
    API server <--Placed/Finished/UnitReset--> the other API servers (--api-server-count)

With several API servers, a request's outputs go back to the one that sent it:
its request id begins with that server's index (new_request_id), and the
workers send every other part of a WorkerOutput (stats, ready) to all of them.
When one dies, API server 0 has the units stop its requests by that prefix.

A request's generated tokens reach the API server from up to two senders (the
prefill worker samples the first token, the decode worker the rest), so each
RequestOutput carries the output index of its first token and the API server
puts them in order.

The structs the workers send every step are declared gc=False: they never hold
a reference cycle, and untracked they cost the receiving API server no garbage
collection, which would be its largest cost per streamed token
(docs/benchmarks.md#measurements-behind-the-code).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from engine.sampling_params import SamplingParams, TokenLogprobs
from engine.shared_memory import SharedHandle

Route = Literal["prefill", "decode"]


def new_request_id(api_server: int, serial: int, suffix: str) -> str:
    return f"{request_prefix(api_server)}{serial}-{suffix}"


def request_prefix(api_server: int) -> str:
    """What the id of every request an API server sends begins with."""
    return f"{api_server}-"


def api_server_of(request_id: str) -> int:
    """The index of the API server that sent a request (see new_request_id)."""
    return int(request_id.partition("-")[0])


class GenerateRequest(msgspec.Struct, tag=True):
    """A new request for a unit. `route` is where the router wants the prefill to run when the unit
    has part of the prompt cached; a prompt with no cached prefix always goes to the prefill
    worker. block_hashes: the chain hashes of the prompt's full blocks (engine/prefix_hash.py),
    which the router computed to place it: the unit's prefix cache matches and caches with them
    instead of hashing the prompt again."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    route: Route
    block_hashes: list[int] = []
    # Seconds its cached blocks outrank plain LRU blocks once it ends (the client's cache hints;
    # 0: plain LRU).
    retain_s: float = 0.0


class AbortRequest(msgspec.Struct, tag=True):
    """The client went away or a stop string matched: stop the request and free its blocks."""

    request_id: str


class AbortPrefix(msgspec.Struct, tag=True):
    """An API server died: stop every request whose id begins with `prefix` (request_prefix) and
    free its blocks, as AbortRequest does for one; no one is left to stream their tokens to. Sent
    by API server 0 before it starts the dead one again, so a request of the new one cannot be
    among them."""

    prefix: str


class Hello(msgspec.Struct, tag=True):
    """An API server started (again, after a death): the decode worker answers it alone with what it
    missed, each of the unit's workers' WorkerReady (the prefill worker's relayed), as a unit that
    is up never sends them again."""

    api_server: int


class UnitSetup(msgspec.Struct, tag=True):
    """The decode worker's shared memory, for the prefill worker to map, and the pool it sized.
    Under tensor parallelism, weights and kv_pool are rank 0's, and followers holds every rank's
    (weights, kv_pool) from rank 1."""

    weights: SharedHandle
    kv_pool: SharedHandle
    num_kv_blocks: int
    max_model_len: int
    followers: list[tuple[SharedHandle, SharedHandle]] = []


class PrefillJob(msgspec.Struct, tag=True):
    """Compute token_ids[num_cached:] into block_table (the cached prefix is read in place), sample
    the token at output index `output_index`, report it to the API server and notify the decode
    worker."""

    request_id: str
    token_ids: list[int]
    num_cached: int
    block_table: list[int]
    sampling: SamplingParams
    output_index: int

    @property
    def num_prompt(self) -> int:
        """The request's prompt length (token_ids holds the tokens it already generated after
        it)."""
        return len(self.token_ids) - self.output_index


class AbortPrefill(msgspec.Struct, tag=True):
    """Drop a queued or running prefill job; the prefill worker still answers with PrefillDone."""

    request_id: str


class SetShare(msgspec.Struct, tag=True):
    """Decode worker -> prefill worker: run on these cores (cpu), or on the prefill stream of this
    split (green), from the next forward pass (the share manager's decision)."""

    cores: list[int]
    split: int | None = None


class PrefillReady(msgspec.Struct, tag=True):
    """The prefill worker has mapped the unit's shared memory; ready: what it told the API servers
    (the decode worker relays it to an API server that starts later: Hello)."""

    pid: int
    ready: WorkerReady | None = None


class PrefillDone(msgspec.Struct, tag=True):
    """The job's KV is complete on the device; token_id is None when the job was aborted or
    failed."""

    request_id: str
    token_id: int | None
    error: str | None = None
    error_status: int = (
        500  # the HTTP status the request ends with (400: a reason of its own, RequestFailure)
    )


class RequestOutput(msgspec.Struct, gc=False):
    """New tokens of one request, starting at output index `index`. The first output of a request
    also says where its prefill ran and how many prompt tokens were cached. A set finish_reason
    or error ends it."""

    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    route: Route | None = None
    num_cached_tokens: int | None = None
    error: str | None = None
    error_status: int = (
        500  # the HTTP status the error is answered with: 400 for a request no worker can run
    )
    logprobs: list[TokenLogprobs] | None = (
        None  # one per token of token_ids, when the request asked for them
    )
    # With the first token, when the request asked for prompt logprobs: one per prompt token after
    # the first.
    prompt_logprobs: list[TokenLogprobs] | None = None


# vLLM's buckets of vllm:iteration_tokens_total: a step's tokens (prompt chunks and decodes),
# counted by the worker.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class TierCounts(msgspec.Struct, gc=False):
    """The second KV tier's fill and counters (blocks; counters cumulative since the worker
    started)."""

    capacity: int  # blocks it holds at most
    blocks: int  # blocks it holds now
    block_bytes: int  # bytes of one block across the unit's ranks
    block_size: int  # tokens of one block
    stored: int = 0
    loaded: int = 0
    dropped: int = 0
    tokens_per_s: float = 0.0  # the copies' rate, as measured (0: not yet, or not on this device)


class WorkerStats(msgspec.Struct, gc=False):
    """A decode worker's gauges and counters (counters are cumulative since the worker started)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    device_memory_used: int = 0  # bytes in use on the unit's GPU, by every process (0 on the CPU)
    prefill_queue_tokens: int = (
        0  # uncached prompt tokens handed to the prefill worker and not yet done
    )
    decode_step_ms: float = 0.0  # moving average of decode-only steps (0 until one ran)
    inline_tokens_per_s: float = (
        0.0  # moving average speed of inline prefill tokens (0 until measured)
    )
    # of a mixture of experts: what each expert an inline prefill reads and the decode tokens do
    # not adds to the step (0 until measured; 0 for a dense model)
    inline_expert_ms: float = 0.0
    decode_share: int = 0  # cores the decode worker runs on now (0: not partitioned by cores)
    prefill_share: int = 0  # cores the prefill worker was last given
    share_switches: int = 0  # times the share manager changed the split
    steps: int = 0  # engine steps the decode worker ran
    step_seconds: float = 0.0  # their time (the engine's step: inputs, forward pass, sampling)
    loop_seconds: float = (
        0.0  # the worker's loop around them: messages in, scheduling, outputs out (host time
    )
    #                            that CUDA graphs do not hide)
    partition_problem: str | None = (
        None  # why the unit's partition does not hold (e.g. not an MPS client)
    )
    # Its steps by token count: steps with at most ITERATION_TOKEN_BUCKETS[i] tokens and more than
    # the bucket before (one more count: above the last), and their tokens in all.
    iteration_tokens: list[int] = msgspec.field(default_factory=list)
    iteration_tokens_sum: int = 0
    kv_retained_blocks: int = 0  # evictable blocks a retention hint keeps behind the plain LRU
    tier: TierCounts | None = None  # the second KV tier's (None: --kv-offloading-size unset)


class PrefillStats(msgspec.Struct, gc=False):
    """The prefill worker's measured speed (moving average over its forward passes)."""

    tokens_per_s: float


class WorkerReady(msgspec.Struct, gc=False):
    """A worker finished starting; the unit is ready when both of its workers are (or the decode
    worker alone, aggregated)."""

    role: Literal["prefill", "decode"]
    pid: int
    device: str = "cpu"  # the device's name, e.g. "NVIDIA H100 80GB HBM3"
    device_memory_total: int = 0  # bytes (0 on the CPU)
    num_kv_blocks: int | None = None  # the decode worker's pool, as it sized it
    max_model_len: int | None = None


class WorkerOutput(msgspec.Struct, tag=True, gc=False):
    """One message per worker step to the API server."""

    unit: int
    outputs: list[RequestOutput] = []
    stats: WorkerStats | None = None
    ready: WorkerReady | None = None
    fatal: str | None = (
        None  # the worker cannot start (e.g. the model does not fit): the server stops with this
    )
    prefill_stats: PrefillStats | None = None
    # Requests whose first chunk has just been put in a step of this worker: they no longer wait to
    # be scheduled, so --max-queue-time-s ends them no more (sent before the step runs, which may be
    # a long prefill).
    started: list[str] = []
    # The worker has just stopped a dead API server's requests (AbortPrefix): the requests it holds
    # now, those stopped left out, which every router takes as the unit's load in place of the count
    # it kept.
    held: int | None = None


ToDecode = GenerateRequest | AbortRequest | AbortPrefix | Hello
ToPrefill = UnitSetup | PrefillJob | AbortPrefill | SetShare
FromPrefill = PrefillReady | PrefillDone


class Placed(msgspec.Struct, tag=True, gc=False):
    """An API server placed a request on `unit` (its prompt's block hashes; the session it keeps
    there, if any): the others count it in the unit's load and remember its prefix there, as if
    they had placed it."""

    origin: int  # the API server's index
    unit: int
    hashes: list[int]
    session: str | None = None


class Finished(msgspec.Struct, tag=True, gc=False):
    """A request placed by `origin` ended; `hashes`: its prompt and answer, now likely cached on the
    unit."""

    origin: int
    unit: int
    hashes: list[int]


class UnitReset(msgspec.Struct, tag=True):
    """The launcher (in API server 0) restarts a unit: every API server ends its requests there with
    `message`."""

    origin: int
    unit: int
    message: str


RouterEvent = Placed | Finished | UnitReset
