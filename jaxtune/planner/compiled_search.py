"""The planner's answer checked by the compiler: the longest context, or the largest batch, a TPU slice's compiler
accepts for a plan, found by bisection from the planner's value (a handful of compiles).

    bound = largest_accepted(cfg, plan, get_device("v5e-8"), "seq_len", start=9984, step=256, limit=131072)
    bound.accepted, [(t.value, t.fits) for t in bound.tries]

A value is accepted when the compiled step (`command.confirm_plan`) fits the chip with the runtime's reserve.
From the planner's value the search steps up (or down) by 1, 2, 4, ... steps until the answer changes, then halves
the gap: with the planner within a few steps of the compiler, four or five compiles.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxtune.config import ModelConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.planner.devices import Device

FIELDS = {"seq_len": "context (tokens a row)", "batch_size": "batch (rows a step over all devices)"}


@dataclass(frozen=True)
class Try:
    """One compile: the value, the compiler's verdict and its bytes a device (the iteration's peak)."""

    value: int
    fits: bool
    peak_bytes: int
    seconds: float


@dataclass(frozen=True)
class CompiledBound:
    """The largest `field` value the compiler accepts (None: not even one step), beside the planner's."""

    field: str
    planner: int
    accepted: int | None
    tries: tuple[Try, ...]
    confirmation: object  # command.Confirmation of `accepted` (of the last try when none is)

    def to_dict(self) -> dict:
        return {"field": self.field, "planner": self.planner, "accepted": self.accepted,
                "tries": [{"value": t.value, "fits": t.fits, "peak_bytes": t.peak_bytes,
                           "compile_seconds": round(t.seconds, 1)} for t in self.tries]}


def largest_accepted(cfg: ModelConfig, plan: TrainPlan, device: Device, field: str, start: int, step: int,
                     limit: int) -> CompiledBound:
    """Bisect `plan`'s `field` ("seq_len" or "batch_size") over multiples of `step` up to `limit`, from `start`
    (the planner's answer), on the compiler's verdict for `device` (a TPU slice)."""
    from jaxtune.planner.command import confirm_plan

    tries: list[Try] = []
    confirmations: dict[int, object] = {}

    def fits(value: int) -> bool:
        confirmation = confirm_plan(cfg, plan.replace(**{field: value}), device)
        confirmations[value] = confirmation
        tries.append(Try(value, confirmation.fits, confirmation.peak_bytes,
                         confirmation.compiled.compile_seconds))
        return confirmation.fits

    limit = max(step, limit // step * step)
    first = max(step, min(limit, start // step * step))
    lo, hi = (first, None) if fits(first) else (None, first)  # largest known to fit, smallest known refused
    delta = step
    while lo is not None and hi is None and lo < limit:  # up: 1, 2, 4, ... steps until refused (or the limit)
        value = min(lo + delta, limit)
        if fits(value):
            lo, delta = value, 2 * delta
        else:
            hi = value
    while lo is None and hi > step:  # down: 1, 2, 4, ... steps until accepted (or the first step refused)
        value = max(hi - delta, step)
        if fits(value):
            lo = value
        else:
            hi, delta = value, 2 * delta
    while lo is not None and hi is not None and hi - lo > step:
        mid = lo + (hi - lo) // step // 2 * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    shown = lo if lo is not None else tries[-1].value
    return CompiledBound(field, start, lo, tuple(tries), confirmations[shown])


def format_bound(bound: CompiledBound, topology: str) -> str:
    """"the compiler's longest context for v5e:2x2 ...: 10,240 (planner 9,984); compiled 9,984 fits, ..." """
    what = FIELDS[bound.field]
    tried = ", ".join(f"{t.value:,} {'fits' if t.fits else 'refused'}" for t in bound.tries)
    seconds = sum(t.seconds for t in bound.tries)
    found = f"{bound.accepted:,}" if bound.accepted is not None else "none (not even the smallest)"
    return (f"the largest {what} the TPU compiler accepts for {topology}: {found} (planner {bound.planner:,}); "
            f"compiled {tried} ({len(bound.tries)} compiles, {seconds:.0f} s)")
