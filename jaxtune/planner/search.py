"""Plan search (`search -> SearchResult`): every way of running a fine-tune on a target that fits, ranked by
predicted step time.

For a model, a base plan (method, sequence length, dtypes) and a target with its device count, the search tries
the split of the global batch into micro-batch x accumulation, the remat policies, the meshes the devices factor
into (`meshes`: a context axis too, for long rows), QLoRA's 4 and 8 bits, and the optimizer state in host memory;
it keeps the plans that fit, ranks them by predicted step time (timing.py) and says why the best ones win
(`explain`). When nothing fits, `smallest_change` finds the least change that would: offloading, a lighter method,
a shorter sequence, a batch of 1, more devices, a bigger device. `longest_context`: the longest sequence that fits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from jaxtune.config import MeshConfig, ModelConfig, OffloadConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.config.run import batch_ways, context_split_error
from jaxtune.errors import JaxtuneError
from jaxtune.methods.base import method_unit
from jaxtune.parallel.rules import ZERO_AXES
from jaxtune.planner.devices import CATALOGUE, Device
from jaxtune.planner.estimate import Estimate, estimate, zero_ways
from jaxtune.planner.timing import StepTime, step_time

REMATS = ("none", "save_matmuls", "full", "offload")
OFFLOADING_FAMILIES = ("gpu", "tpu")  # where remat "offload" moves the layer inputs to pinned host memory
GiB = 1 << 30


@dataclass(frozen=True)
class Candidate:
    estimate: Estimate
    time: StepTime

    @property
    def plan(self) -> TrainPlan:
        return self.estimate.plan


@dataclass(frozen=True)
class SearchResult:
    """Fitting candidates, fastest first; `tried` counts every plan estimated. When none fits, `suggestion` is the
    smallest change found that makes one fit (or says that none was found)."""

    candidates: tuple[Candidate, ...]
    tried: int
    suggestion: str | None = None
    suggested: Candidate | None = None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(cfg: ModelConfig, count: int, seq_len: int) -> list[MeshConfig]:
    """Every (data, fsdp, context, tensor) split of `count` devices whose tensor axis divides the kv heads (and is at
    most 8, one host's NVLink/ICI neighbourhood) and whose context axis splits rows of `seq_len` tokens (into 2 x
    context chunks). A context axis is what a long row needs: fsdp splits rows, so a batch of one long row runs on
    one fsdp device."""
    out = []
    for tensor in _divisors(count):
        if tensor > 8 or cfg.num_kv_heads % tensor:
            continue
        for context in _divisors(count // tensor):
            if context_split_error(seq_len, context):
                continue
            for fsdp in _divisors(count // (tensor * context)):
                out.append(MeshConfig(count // (tensor * context * fsdp), fsdp, context=context, tensor=tensor))
    return out


def _batch_splits(global_batch: int, ways: int) -> list[tuple[int, int]]:
    """(micro-batch rows over the mesh, accumulation steps) with rows a multiple of `ways` and rows x steps equal to
    the global batch."""
    if global_batch % ways:
        return []
    per = global_batch // ways
    return [(ways * k, per // k) for k in _divisors(per)]


def _variants(cfg: ModelConfig, base: TrainPlan, device: Device, global_batch: int, fixed: set[str]):
    mesh_options = [base.mesh] if "mesh" in fixed else meshes(cfg, device.count, base.seq_len)
    remat_options = [base.forward.remat.policy] if "remat" in fixed else [
        r for r in REMATS if r != "offload" or device.family in OFFLOADING_FAMILIES]
    varied = {name: values for name, values in method_unit(base.method).costs.searched.items() if name not in fixed}
    methods = [base.method.replace(**dict(zip(varied, values))) for values in itertools.product(*varied.values())]
    offloads = [base.offload] if "offload" in fixed else [base.offload, replace(base.offload, optimizer_state=True)]
    for mesh, remat, method, offload in itertools.product(mesh_options, remat_options, methods, offloads):
        try:
            sizes = mesh.resolve(device.count)
        except JaxtuneError:
            continue
        ways = batch_ways(sizes)
        splits = [(base.batch_size, base.grad_accum)] if "batch" in fixed else _batch_splits(global_batch, ways)
        for rows, accum in splits:
            yield base.replace(mesh=MeshConfig(**sizes), remat=remat, method=method, offload=offload,
                               batch_size=rows, grad_accum=accum)


def search(cfg: ModelConfig, base: TrainPlan, device: Device, global_batch: int | None = None,
           fixed: tuple[str, ...] = ()) -> SearchResult:
    """Fitting plans for `cfg` on `device`, fastest first.

    global_batch: rows per optimizer step (default: the base plan's batch_size x grad_accum).
    fixed: choices the search must keep from `base`: any of "mesh", "remat", "bits", "offload", "batch".
    """
    global_batch = global_batch or base.global_batch
    fitting, tried = _fitting(cfg, base, device, global_batch, set(fixed))
    if fitting:
        return SearchResult(tuple(fitting), tried)
    suggestion, suggested = smallest_change(cfg, base, device, global_batch, fixed)
    return SearchResult((), tried, suggestion, suggested)


def _estimates(cfg: ModelConfig, base: TrainPlan, device: Device, global_batch: int,
               fixed: set[str]) -> tuple[list[Estimate], int]:
    """(the estimate of every variant of `base` the device can run, number of distinct plans tried)."""
    seen, estimates = set(), []
    for plan in _variants(cfg, base, device, global_batch, fixed):
        if plan in seen:
            continue
        seen.add(plan)
        try:
            estimates.append(estimate(cfg, plan, device))
        except JaxtuneError:
            continue
    return estimates, len(seen)


def _fitting(cfg: ModelConfig, base: TrainPlan, device: Device, global_batch: int, fixed: set[str]):
    """(fitting candidates, number of plans estimated) over every variant of `base`."""
    estimates, tried = _estimates(cfg, base, device, global_batch, fixed)
    fitting = [Candidate(est, step_time(est)) for est in estimates if est.fits]
    # Equal times (compute-bound plans often tie): less recomputation, rows split over fewer devices, fewer
    # accumulation steps, less memory.
    fitting.sort(key=lambda c: (float(f"{c.time.step_s:.3g}"), REMATS.index(c.plan.forward.remat.policy),
                                c.estimate.mesh["context"],
                                c.plan.grad_accum, c.estimate.total_bytes))
    return fitting, tried


def smallest_change(cfg: ModelConfig, base: TrainPlan, device: Device, global_batch: int,
                    fixed: tuple[str, ...] = ()) -> tuple[str, Candidate | None]:
    """The first change, in order of how little it changes the run, under which some plan fits."""
    free = tuple(f for f in fixed if f not in ("offload", "remat", "batch"))
    tries: list[tuple[str, TrainPlan, Device, int]] = []
    tries.append(("keep Adam's moments in bfloat16 and the optimizer state in host memory",
                  base.replace(offload=OffloadConfig(True, base.offload.frozen_params, "bfloat16")), device,
                  global_batch))
    lighter = method_unit(base.method).costs.lighter(base.method)  # ((what to say, options), ...)
    for label, m in lighter:
        tries.append((f"{label} instead of {base.method.kind}", base.replace(method=m), device, global_batch))
    seq = base.seq_len // 2
    while seq >= 128 and not context_split_error(seq, base.mesh.context):
        tries.append((f"sequence length {seq} instead of {base.seq_len}", base.replace(seq_len=seq), device,
                      global_batch))
        seq //= 2
    if global_batch > 1:
        tries.append((f"global batch 1 instead of {global_batch}", base.replace(batch_size=1, grad_accum=1), device,
                      1))
    unit = 2 if device.family == "tpu" and device.name in ("v4", "v5p") else 1
    limit = 512 if device.family == "tpu" else 64
    count = device.count * 2
    while count <= limit:
        target = device.with_count(count)
        tries.append((f"{count} x {device.name} instead of {device.count} (target {device.name}-{count * unit})",
                      base.replace(mesh=MeshConfig()), target, -(-global_batch // count) * count))
        count *= 2
    for other in sorted(CATALOGUE.values(), key=lambda d: d.usable_bytes):
        if other.usable_bytes > device.usable_bytes:
            tries.append((f"{device.count} x {other.name} ({other.memory_bytes / GiB:.0f} GiB) instead of "
                          f"{device.name}", base, other.with_count(device.count), global_batch))
    for i, (label, plan, target, batch) in enumerate(tries):
        fitting, _ = _fitting(cfg, plan, target, batch, set(free))
        if fitting:
            if plan.method != base.method:  # also say what keeping the method would take
                for more_label, more_plan, more_target, more_batch in tries[i + 1:]:
                    if more_target is not device and _fitting(cfg, more_plan, more_target, more_batch, set(free))[0]:
                        return f"{label}; keeping {base.method.kind}: {more_label}", fitting[0]
            return label, fitting[0]
    # No single change: a lighter method together with more devices or a larger device.
    for name, m in lighter:
        for label, plan, target, batch in tries:
            if target is device or plan.method != base.method:
                continue
            fitting, _ = _fitting(cfg, plan.replace(method=m), target, batch, set(free))
            if fitting:
                return f"{name} instead of {base.method.kind}, and {label}", fitting[0]
    return ("nothing tried fits: offloading, lighter methods, shorter sequences, a batch of 1, up to "
            f"{limit} devices, every larger device, and a lighter method with more or larger devices"), None


@dataclass(frozen=True)
class LongestContext:
    """The longest sequence, a multiple of the step tried, at which some plan fits, and its fastest plan.
    `too_long` is the next multiple, which does not fit, and `leanest_too_long` the plan needing least memory there;
    both are None when the model's own context (`context`, its max_position_embeddings) is the limit."""

    seq_len: int
    fastest: Candidate
    too_long: int | None
    leanest_too_long: Estimate | None
    context: int
    lengths_searched: int


def longest_context(cfg: ModelConfig, base: TrainPlan, device: Device, step: int = 256,
                    fixed: tuple[str, ...] = ()) -> LongestContext:
    """The longest multiple of `step` tokens, up to the model's context, at which some plan of `base` fits `device`.

    The plans are the search's variants (remat, mesh, batch split, QLoRA bits, offload; `fixed` keeps choices from
    `base` as in `search`), at the global batch of `base`. Every plan's memory grows with the length (linearly:
    blockwise attention, the chunked loss), so lengths double from `step` until one does not fit, then bisect. Each
    new length costs an abstract run per layout, which adds up on large meshes, so a length stops at the first plan
    that fits (the last one to fit is tried first) and a plan that did not fit is not tried again at a longer length;
    the full search runs once, at the answer. Raises a JaxtuneError when not even the shortest length fits.
    """
    if step < 1:
        raise JaxtuneError(f"step {step} (--seq-step): the lengths tried are its multiples; use a positive number of "
                           "tokens")
    context = cfg.max_position_embeddings
    first, last = step * (base.generate_tokens // step + 1), context // step * step  # GRPO: longer than its rollout
    if first > last:
        raise JaxtuneError(f"the model's context of {context} tokens (max_position_embeddings) is shorter than the "
                           f"shortest length tried, {first}")
    fits_to: dict[TrainPlan, int] = {}  # a variant (its plan at the first length) -> the longest length it fits
    fails_from: dict[TrainPlan, int] = {}  # a variant -> the shortest length at which it does not fit
    lengths: list[int] = []

    def fits_at(seq_len: int) -> bool:
        lengths.append(seq_len)
        variants = dict.fromkeys(_variants(cfg, base.replace(seq_len=seq_len), device, base.global_batch, set(fixed)))
        for plan in sorted(variants, key=lambda p: -fits_to.get(p.replace(seq_len=first), 0)):
            variant = plan.replace(seq_len=first)
            if fails_from.get(variant, seq_len + 1) <= seq_len:
                continue
            try:
                fits = estimate(cfg, plan, device).fits
            except JaxtuneError:
                fits = False
            if fits:
                fits_to[variant] = seq_len
                return True
            fails_from[variant] = seq_len
        return False

    def leanest_at(seq_len: int) -> Estimate | None:
        estimates, _ = _estimates(cfg, base.replace(seq_len=seq_len), device, base.global_batch, set(fixed))
        return min(estimates, key=lambda e: e.peak_bytes, default=None)

    if not fits_at(first):
        leanest = leanest_at(first)
        needed = (f" (the leanest needs {leanest.peak_bytes / GiB:.1f} GiB, {device.usable_bytes / GiB:.1f} GiB "
                  "usable)") if leanest else ""
        raise JaxtuneError(f"no plan with method {base.method.kind} fits {device.target} even at the shortest length "
                           f"tried, {first} tokens{needed}")
    longest, too_long = first, None
    while too_long is None and longest < last:  # double
        seq_len = min(2 * longest, last)
        if fits_at(seq_len):
            longest = seq_len
        else:
            too_long = seq_len
    while too_long is not None and too_long - longest > step:  # bisect
        seq_len = longest + (too_long - longest) // step // 2 * step
        if fits_at(seq_len):
            longest = seq_len
        else:
            too_long = seq_len
    fitting, _ = _fitting(cfg, base.replace(seq_len=longest), device, base.global_batch, set(fixed))
    leanest = leanest_at(too_long) if too_long is not None else None
    return LongestContext(longest, fitting[0], too_long, leanest, context, len(lengths))


def explain(candidate: Candidate, others: tuple[Candidate, ...] = ()) -> list[str]:
    """Why this plan: what bounds it, where its memory goes, what each choice buys."""
    est, t, plan = candidate.estimate, candidate.time, candidate.plan
    usable = est.device.usable_bytes
    lines = [f"{est.total_bytes / GiB:.1f} of {usable / GiB:.1f} GiB usable per device "
             f"({100 * (1 - est.total_bytes / usable):.0f}% headroom); peak in the {est.peak_phase}; "
             f"{t.step_s:.3g} s a step, {t.tokens_per_s:,.0f} tokens/s, {t.bound}-bound"]
    mesh, zero = est.mesh, zero_ways(est.mesh)
    if zero > 1:
        axes = " x ".join(f"{axis}={mesh[axis]}" for axis in ZERO_AXES if mesh[axis] > 1)
        lines.append(f"{axes} splits weights, gradients and optimizer state {zero} ways "
                     f"(model states {est.model_states_bytes / GiB:.1f} GiB a device)")
    if mesh["context"] > 1:
        how = ("passing key/value blocks round a ring" if plan.forward.context_attention == "ring" else
               "gathering each layer's keys and values")
        lines.append(f"context={mesh['context']} splits each row's {plan.seq_len:,} tokens, "
                     f"{plan.seq_len // mesh['context']:,} a device; attention reaches the others' by {how}")
    if mesh["tensor"] > 1:
        lines.append(f"tensor={mesh['tensor']} splits heads, MLP and vocabulary: activations per device shrink, at "
                     f"the cost of per-layer all-reduces")
    if mesh["data"] > 1:
        lines.append(f"data={mesh['data']} replicates the weights: no gathers, one gradient all-reduce a step")
    if plan.grad_accum > 1:
        lines.append(f"{plan.batch_size} rows a micro-batch x {plan.grad_accum} accumulation steps reach the global "
                     f"batch of {plan.global_batch} without holding it all at once")
    if plan.forward.remat.policy != "none":
        lighter = estimate(est.model, plan.replace(remat="none"), est.device)
        verdict = "does not fit" if not lighter.fits else "fits but ranks lower"
        lines.append(f"remat {plan.forward.remat.policy}: without remat the step needs "
                     f"{lighter.total_bytes / GiB:.1f} GiB "
                     f"({verdict})")
    if est.offloaded_activations_bytes:
        lines.append(f"layer inputs in pinned host memory ({est.offloaded_activations_bytes / GiB:.1f} GiB), out and "
                     f"back over the host link each micro-batch ({t.offload_s:.3g} s beside the layers' compute)")
    if plan.offload.optimizer_state:
        lines.append(f"optimizer state in host memory ({est.host_bytes / GiB:.1f} GiB), moved each step over the "
                     f"host link ({t.host_s:.3g} s)")
    return lines
