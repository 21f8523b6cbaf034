"""The planner's answer checked by the compiler: the longest context, or the largest batch, a TPU slice's compiler
accepts for a plan, found by bisection from the planner's value.

    bound = largest_accepted(cfg, plan, get_device("v5e-8"), "seq_len", start=9984, step=256, limit=131072)
    bound.accepted, [(t.value, t.fits) for t in bound.tries]

A value is accepted when the compiled step (`confirm_plan`, here) fits the chip with the runtime's reserve.
From the planner's value the search steps up (or down) by 1, 2, 4, ... steps until the answer changes, then halves
the gap, so the closer the planner is to the compiler, the fewer compiles. `jaxtune plan --search --confirm` runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax

from jaxtune.config import ModelConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.planner.confirm import CompiledMemory, compile_rollout, compile_step
from jaxtune.planner.devices import Device, get_device
from jaxtune.planner.estimate import Estimate, estimate
from jaxtune.planner.slices import describe, libtpu_quiet, topology_devices, tpu_slice
from jaxtune.planner.timing import step_time


@dataclass(frozen=True)
class Confirmation:
    """What compiling a plan said: XLA's `compiled` memory (None where no compiler for the target is here, with
    `skipped` saying why), the planner's `estimate` of the same plan with the compiling backend's rules, the
    compiler's verdict against the target's memory, and for a TPU slice its topology and a step time modelled from
    the compiler's FLOPs and bytes at the chip's peak rates."""

    compiled: CompiledMemory | None
    estimate: Estimate
    skipped: str = ""
    topology: str = ""
    rollout: CompiledMemory | None = None

    @property
    def peak_bytes(self) -> int:
        """The compiled per-device bytes of the iteration's peak: the step's, or GRPO's rollout's (on the same mesh)
        with the optimizer state beside it."""
        assert self.compiled is not None  # not a skipped confirmation
        step = self.compiled.total_bytes
        return max(step, self.rollout.total_bytes + self.estimate.optimizer_bytes) if self.rollout else step

    @property
    def fits(self) -> bool:
        """The compiler's bytes and the runtime's reserve within the device's usable memory (never when the compiler
        refused the program as over the device's memory)."""
        assert self.compiled is not None  # not a skipped confirmation
        if self.compiled.over_memory:
            return False
        return self.peak_bytes + self.estimate.reserve_bytes <= self.estimate.device.usable_bytes

    def modelled_step(self) -> dict:
        """A step time from the program's FLOPs at the device's peak FLOP/s (a model, never a measurement: the
        roofline's compute side; XLA's bytes accessed count a loop body once, so no memory side is modelled), and
        the share of those FLOPs the planner counts as the step's useful work."""
        assert self.compiled is not None  # not a skipped confirmation
        device, compute = self.estimate.device, self.estimate.plan.forward.compute_dtype
        seconds = self.compiled.flops / device.peak(compute)
        planned = step_time(self.estimate)  # the step's FLOPs (a GRPO rollout is a program of its own)
        useful = (planned.flops - planned.rollout_flops) / device.count
        return {"modelled_step_seconds": seconds, "planner_flops": useful,
                "useful_share": useful / self.compiled.flops if self.compiled.flops else 0.0}

    def to_dict(self) -> dict:
        if self.compiled is None:
            return {"skipped": self.skipped, "estimate_device": self.estimate.device.target}
        out = {**self.compiled.to_dict(), "estimate_bytes": self.estimate.compiled_bytes,
               "estimate_device": self.estimate.device.target,
               "peak_bytes": self.peak_bytes, "relative_error": self.estimate.compiled_bytes / self.peak_bytes - 1,
               "remat": self.estimate.plan.forward.remat.policy, "fits": self.fits,
               "reserve_bytes": self.estimate.reserve_bytes,
               "usable_bytes": self.estimate.device.usable_bytes}
        if self.rollout is not None:
            out["rollout"] = self.rollout.to_dict()
        if self.topology:
            out["topology"] = self.topology
            out.update(self.modelled_step())
        return out


def confirm_plan(cfg: ModelConfig, plan: TrainPlan, target: Device) -> Confirmation:
    """Compile the real step of `plan`: for a TPU target with the TPU compiler, for that slice's topology on any
    host (`planner.slices`; `[mesh] slices` such slices joined over DCN, `target` being one of them); for a GPU
    target only where this backend is a GPU (else a `Confirmation` that says so and keeps the planner's figure);
    otherwise on this backend (fake CPU devices for a mesh), beside the planner's
    estimate with that backend's rules (the target's when it is of the backend's family, else a stand-in)."""
    count = math.prod(plan.mesh.sizes().values())
    family = jax.default_backend()  # "cpu", "gpu" or "tpu"
    if target.family == "tpu" and family != "tpu":
        slice_ = tpu_slice(target)
        devices = topology_devices(slice_, plan.mesh.slices)
        with libtpu_quiet():
            compiled = compile_step(cfg, plan, devices)
            rollout = compile_rollout(cfg, plan, devices) if plan.generate_tokens else None
        return Confirmation(compiled, estimate(cfg, plan, target.with_count(count)),
                            topology=describe(slice_, plan.mesh.slices), rollout=rollout)
    if target.family in ("gpu", "gaudi") and family != target.family:
        return Confirmation(None, estimate(cfg, plan, target.with_count(count)),
                            skipped=f"no {target.family.upper()} compiler runs without a {target.family.upper()}: "
                                    f"this host's backend is {jax.default_backend()}, so the planner's figure stands")
    compiled = compile_step(cfg, plan)
    if target.family == family:
        here = target.with_count(count)
    else:
        here = get_device({"cpu": "cpu", "gpu": "h100-80gb", "tpu": "v5p"}[family])
        here = get_device(f"cpu-{count}") if family == "cpu" and count > 1 else here.with_count(count)
    return Confirmation(compiled, estimate(cfg, plan, here))


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
    confirmation: Confirmation  # of `accepted` (of the last try when none is)

    def to_dict(self) -> dict:
        return {"field": self.field, "planner": self.planner, "accepted": self.accepted,
                "tries": [{"value": t.value, "fits": t.fits, "peak_bytes": t.peak_bytes,
                           "compile_seconds": round(t.seconds, 1)} for t in self.tries]}


def largest_accepted(cfg: ModelConfig, plan: TrainPlan, device: Device, field: str, start: int, step: int,
                     limit: int) -> CompiledBound:
    """Bisect `plan`'s `field` ("seq_len" or "batch_size") over multiples of `step` up to `limit`, from `start`
    (the planner's answer), on the compiler's verdict for `device` (a TPU slice)."""
    tries: list[Try] = []
    confirmations: dict[int, Confirmation] = {}

    def fits(value: int) -> bool:
        confirmation = confirm_plan(cfg, plan.replace(**{field: value}), device)
        assert confirmation.compiled is not None  # a TPU slice's step is compiled
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
    while lo is None and hi is not None and hi > step:  # down: 1, 2, 4, ... steps until accepted (or `step` refused)
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
