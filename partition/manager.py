"""The adaptive share manager (RAPID-Serve's idea): give decode the smallest share that keeps its
step within the inter-token SLO at its current batch and context, and prefill the rest; when one
side is idle, let the other use the whole device, where the profile shows that the whole device
is faster for it.

It runs in the decode worker, once per step, and only where shares can change at run time: the cpu
backend (a share is a number of cores, any from 1 up) and the green backend (a share is a number of
SMs, one of the splits made at start; `units` are then SM indices and `sizes` the splits' decode
counts). Its inputs are what that worker knows at no cost: its batch, the mean context of its
sequences, and the uncached tokens queued on the prefill worker. Every change rests on the partition
profile (`ppd profile partition`): predicted decode step time by share x batch x context, and
prefill speed by share x prompt. A side alone gets the whole device only if the profile predicts it
at least WHOLE_GAIN faster there (on a small CPU model one more core does not speed a decode step
up, and moving threads costs); with both busy, decode gets the fewest cores that meet --itl-slo-ms.
Without a profile nothing changes: the split it started with stays, and the log says so.

A small queued prefill does not split the device: taking units from decode for a prefill that ends
within about a step costs decode more than that prefill's contention does. With both workers busy,
the prefill runs beside decode on the whole device (both sides overlapping, decode keeping every
unit; reason "small_prefill") when the profile predicts both of:
- it ends within SMALL_PREFILL_STEPS decode steps: its tokens at the whole device's prefill speed
  (never less than the fastest forward pass measured, decode's step at the smallest batch and
  context) take no longer than decode's step on the whole device at this batch and context, so no
  token waits much more than one extra step;
- that delay is no more than what the split would cost decode: while the device works on the
  prefill, decode is delayed by at most the prefill's time alone, while a split, once made, holds
  for at least `hold_steps` steps (the relief waits that long), each slower by decode's step on its
  share minus its step on the whole device. The queued-token threshold this draws therefore grows
  with decode's step (batch, context) and with what the share loses; where the profile lacks a
  figure it needs (a share not measured), the split is made as before.

To keep the workers from flapping, a change that gives decode more (a contender arrived, the batch
grew) is made at once, and one that gives decode less, or lets both spread over the whole device
again, only after the same decision held for `hold_steps` steps in a row.

Where switching costs nothing (green: another stream is picked, no thread moves), a side alone gets
the whole device with or without a profile (`free_switches`): a memory-bound decode step gains
little from the rest of the SMs, but loses nothing either, and decode on the whole device is what a
small prefill then leaves it (above).
"""

from __future__ import annotations

from dataclasses import dataclass

from partition.profile import PartitionProfile

DEFAULT_HOLD_STEPS = 8
WHOLE_GAIN = (
    1.15  # a side alone spreads over every core only if the profile says that is this much faster
)
SMALL_PREFILL_STEPS = (
    1.0  # a prefill the whole device ends within this many decode steps runs beside decode, unsplit
)


@dataclass(frozen=True)
class Split:
    """Cores for each worker; overlapping (both the whole set) when one side is idle."""

    decode: tuple[int, ...]
    prefill: tuple[int, ...]

    @property
    def shared(self) -> bool:
        return bool(set(self.decode) & set(self.prefill))


class ShareManager:
    def __init__(
        self,
        cores: tuple[int, ...],
        start: Split,
        profile: PartitionProfile | None = None,
        itl_slo_ms: float | None = None,
        hold_steps: int = DEFAULT_HOLD_STEPS,
        sizes: tuple[int, ...] | None = None,
        free_switches: bool = False,
    ) -> None:
        if len(cores) < 2:
            raise ValueError("a share manager needs at least two cores to split")
        self.cores, self.profile, self.itl_slo_ms, self.hold_steps = (
            tuple(cores),
            profile,
            itl_slo_ms,
            hold_steps,
        )
        self.sizes = (
            tuple(sorted(sizes)) if sizes else tuple(range(1, len(cores)))
        )  # decode's possible shares
        if not self.sizes or self.sizes[0] < 1 or self.sizes[-1] >= len(cores):
            raise ValueError(
                f"decode's shares {self.sizes} must leave both sides some of the {len(cores)} units"
            )
        self.free_switches = free_switches
        self.current = start
        self.even = self.snap(len(start.decode) if not start.shared else len(cores) // 2)
        self.pending: Split | None = None
        self.pending_steps = 0
        self.switches = 0
        self.reason = "start"

    @property
    def sized_by_slo(self) -> bool:
        return self.profile is not None and self.itl_slo_ms is not None

    def target(self, batch: int, mean_context: float, prefill_tokens: int) -> tuple[Split, str]:
        """The split this state calls for, and why (one word, for the log)."""
        whole, n = self.cores, self.even
        alone = (batch == 0) != (prefill_tokens == 0)
        if alone and (
            self.free_switches
            or (
                self.profile is not None
                and self._whole_pays(batch, mean_context, prefill_tokens or None)
            )
        ):
            return Split(whole, whole), "prefill_idle" if prefill_tokens == 0 else "decode_idle"
        if self.profile is None:
            return Split(whole[:n], whole[n:]), "no_profile"
        if batch == 0 or prefill_tokens == 0:
            return self.current, "idle"  # nothing to gain from moving
        if not self.sized_by_slo:
            reason = "even"
        else:
            need = self.profile.min_decode_share(batch, round(mean_context), self.itl_slo_ms)
            n, reason = (
                (self.sizes[-1], "slo_unreachable") if need is None else (self.snap(need), "slo")
            )
        if self.small_prefill(batch, mean_context, prefill_tokens, n):
            return Split(whole, whole), "small_prefill"
        return Split(whole[:n], whole[n:]), reason

    def snap(self, n: int) -> int:
        """The smallest share decode can have that is at least n (the largest if none is)."""
        return next((s for s in self.sizes if s >= n), self.sizes[-1])

    def small_prefill(
        self, batch: int, context: float, prefill_tokens: int, decode_share: int
    ) -> bool:
        """Whether the profile says prefill_tokens should run beside decode on the whole device
        rather than split it with decode on decode_share (the rule in the module docstring);
        False where it lacks a figure."""
        total, context = len(self.cores), round(context)
        whole = self.profile.decode_step_ms(total, batch, context)
        on_share = self.profile.decode_step_ms(decode_share, batch, context)
        fastest = self.profile.decode_step_ms(total, 1, 0)
        rate = self.profile.prefill_tokens_per_s(total, prefill_tokens)
        if whole is None or on_share is None or fastest is None or not rate:
            return False
        prefill_ms = max(1000.0 * prefill_tokens / rate, fastest)
        return prefill_ms <= min(SMALL_PREFILL_STEPS * whole, self.hold_steps * (on_share - whole))

    def _whole_pays(self, batch: int, context: float, prefill_tokens: int | None) -> bool:
        """Whether the profile predicts the side alone (decode when prefill_tokens is None)
        WHOLE_GAIN faster on every core than on its share of the split."""
        total, n = len(self.cores), self.even
        if prefill_tokens is None:
            alone, split = (
                self.profile.decode_step_ms(total, batch, round(context)),
                self.profile.decode_step_ms(n, batch, round(context)),
            )
            return alone is not None and split is not None and split >= WHOLE_GAIN * alone
        alone, split = (
            self.profile.prefill_tokens_per_s(total, prefill_tokens),
            self.profile.prefill_tokens_per_s(total - n, prefill_tokens),
        )
        return alone is not None and split is not None and alone >= WHOLE_GAIN * split

    def decide(self, batch: int, mean_context: float, prefill_tokens: int) -> Split | None:
        """Called once per decode step: the new split when it changes now, else None."""
        target, reason = self.target(batch, mean_context, prefill_tokens)
        if target == self.current:
            self.pending, self.pending_steps = None, 0
            return None
        if self._tightens(target):
            return self._switch(target, reason)
        if target == self.pending:
            self.pending_steps += 1
        else:
            self.pending, self.pending_steps = target, 1
        return self._switch(target, reason) if self.pending_steps >= self.hold_steps else None

    def _tightens(self, target: Split) -> bool:
        """Whether target protects decode more than the current split: it ends an overlap (a
        contender arrived) or gives decode more cores."""
        if self.current.shared and not target.shared:
            return True
        return not target.shared and len(target.decode) > len(self.current.decode)

    def _switch(self, target: Split, reason: str) -> Split:
        self.current, self.pending, self.pending_steps, self.reason = target, None, 0, reason
        self.switches += 1
        return target
