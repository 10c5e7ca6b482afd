"""What a unit's workers need to start: one dataclass, built by the launcher from the command line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

POLICIES = ("pd", "dlocal", "ppd", "aggregated")


@dataclass(frozen=True)
class UnitConfig:
    """Settings shared by the decode and prefill worker of one unit."""

    model: str                      # a model folder (the launcher resolves "demo")
    num_kv_blocks: int              # the KV pool, sized by the launcher (it checks max_model_len fits)
    unit: int = 0
    dtype: str = "auto"
    load_format: str = "auto"
    block_size: int = 16
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "ppd"
    ipc_dir: str = "/tmp"
    shm_prefix: str = "ppd"
    decode_cores: tuple[int, ...] = ()     # empty: no pinning
    prefill_cores: tuple[int, ...] = ()

    @property
    def aggregated(self) -> bool:
        return self.policy == "aggregated"

    def address(self, name: str) -> str:
        """A ZeroMQ ipc:// endpoint of this unit (or shared by all units when name has no unit suffix)."""
        return f"ipc://{Path(self.ipc_dir) / name}"

    def shm_name(self, kind: str) -> str:
        """The /dev/shm file name of this unit's shared "weights" or "kv"."""
        return f"{self.shm_prefix}-u{self.unit}-{kind}"

    @property
    def requests_address(self) -> str:
        return self.address(f"u{self.unit}-requests")

    @property
    def outputs_address(self) -> str:
        return self.address("outputs")

    @property
    def jobs_address(self) -> str:
        return self.address(f"u{self.unit}-jobs")

    @property
    def notify_address(self) -> str:
        return self.address(f"u{self.unit}-notify")
