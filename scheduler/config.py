"""What a unit's workers need to start: one dataclass, built by the launcher from the command
line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.engine import EngineConfig
from engine.kv_events import KVEventsConfig
from partition.backends import UnitPartition

POLICIES = ("pd", "dlocal", "ppd", "aggregated")
PREFILL_WORKERS = (
    "process",
    "thread",
    "none",
)  # a unit's shapes: where its prefill worker runs (UnitConfig)


def has_prefill_worker(policy: str) -> bool:
    """Whether units serving `policy` have a prefill worker: all but aggregated, whose one worker
    runs every prefill."""
    return policy != "aggregated"


@dataclass(frozen=True)
class UnitConfig:
    """Settings shared by the decode and prefill worker of one unit (one GPU, or a share of the
    CPU's cores)."""

    engine: EngineConfig
    unit: int = 0
    policy: str = "ppd"
    ipc_dir: str = "/tmp"
    shm_prefix: str = "ppd"
    gpu: str | None = (
        # this unit's GPU(s) as CUDA_VISIBLE_DEVICES entries, one per tensor-parallel rank; None on
        # the CPU
        None
    )
    partition: UnitPartition = (
        UnitPartition()
    )  # how the workers share the device (partition/backends.py)
    share_manager: bool = (
        False  # shares change at run time where the backend can (partition/manager.py)
    )
    partition_profile: str | None = (
        None  # the partition profile the share manager reads (None: none found)
    )
    itl_slo_ms: float | None = None  # the share manager keeps decode steps within it
    prefill_batch_tokens: int | None = (
        None  # inline prefills after the first join a step below this (--prefill-batch-tokens)
    )
    async_scheduling: bool = (
        False  # build the next step while one runs on the device (--async-scheduling)
    )
    log_level: str = "info"
    stub_step_ms: float | None = (
        None  # no model: a stand-in worker emits a token per request this often (stub_worker.py)
    )
    api_servers: int = 1  # API-server processes sending to the unit (--api-server-count)
    kv_events: KVEventsConfig | None = (
        None  # the decode worker publishes KV-cache events (--kv-events-config)
    )
    hash_algo: str = "sha256"  # the events' block hashes (--prefix-caching-hash-algo)
    kv_offloading_gib: float = 0.0  # the second KV tier's size, summed over the unit's ranks
    kv_offloading_dir: str | None = None  # the CPU tier's folder (None: the cache folder's)
    kv_retention_share: float = 0.25  # of the pool, at most, kept behind the LRU by cache hints

    @property
    def tensor_parallel_size(self) -> int:
        return self.engine.tensor_parallel_size

    def rank_gpu(self, rank: int) -> str | None:
        """The GPU a tensor-parallel rank runs on (each of a role's ranks on its own; a rank's two
        workers on the same)."""
        return None if self.gpu is None else self.gpu.split(",")[rank]

    def tp_store(self, role: str) -> str:
        """The file where a role's tensor-parallel ranks meet (engine/parallel.py); the launcher
        removes it between runs."""
        return str(Path(self.ipc_dir) / f"u{self.unit}-{role}-tp-store")

    def follower_address(self, role: str, rank: int) -> str:
        """Where tensor-parallel rank `rank` (1..N-1) of a role takes its steps from rank 0 (it
        binds)."""
        return self.address(f"u{self.unit}-{role}-tp{rank}")

    def follower_addresses(self, role: str) -> list[str]:
        """Every follower's address of a role, rank 1 first: where rank 0 sends (FollowerLink)."""
        return [self.follower_address(role, r) for r in range(1, self.tensor_parallel_size)]

    @property
    def publishes_kv_events(self) -> bool:
        return self.kv_events is not None and self.kv_events.publishing

    @property
    def prefill_worker(self) -> str:
        """The unit's shape, decided here and nowhere else: "process" (a prefill worker process
        beside the decode worker's), "thread" (a thread of the decode worker's process: green
        contexts, or --prefill-worker thread) or "none" (aggregated: the decode worker runs every
        prefill)."""
        if not has_prefill_worker(self.policy):
            return "none"
        return "thread" if self.partition.prefill_thread else "process"

    def address(self, name: str) -> str:
        """A ZeroMQ ipc:// endpoint of this unit (or shared by all units when name has no unit
        suffix)."""
        return f"ipc://{Path(self.ipc_dir) / name}"

    def shm_name(self, kind: str, rank: int = 0) -> str:
        """The host name of this unit's shared "weights" or "kv" memory (a /dev/shm file on the
        CPU): a tensor-parallel rank's shard of it."""
        return f"{self.shm_prefix}-u{self.unit}-{kind}" + (f"-r{rank}" if rank else "")

    def requests_address(self, api_server: int) -> str:
        """Where API server `api_server` sends this unit its requests (it binds, the decode worker
        connects)."""
        return self.address(f"u{self.unit}-requests-{api_server}")

    def outputs_address(self, api_server: int) -> str:
        """Where every unit's workers send API server `api_server` its outputs (it binds, the
        workers connect)."""
        return self.address(f"outputs-{api_server}")

    @property
    def router_bus_address(self) -> str:
        """API server 0 publishes every router event here (with several API servers)."""
        return self.address("router-bus")

    @property
    def router_events_address(self) -> str:
        """The other API servers push their router events to API server 0 here."""
        return self.address("router-events")

    @property
    def jobs_address(self) -> str:
        return self.address(f"u{self.unit}-jobs")

    @property
    def notify_address(self) -> str:
        return self.address(f"u{self.unit}-notify")
