"""Plans as people read them (tables: `format_estimate`, `format_search`, `format_longest_context`,
`format_compiled`) and as scripts read them (JSON-ready dicts: `plan_dict`, `longest_context_dict`)."""

from __future__ import annotations

import math

import jax

from jaxtune.methods.base import method_unit
from jaxtune.models.params import ParamSpec
from jaxtune.planner.confirm import CompiledMemory
from jaxtune.planner.estimate import Estimate
from jaxtune.planner.search import LongestContext, SearchResult, explain
from jaxtune.planner.timing import StepTime
from jaxtune.spine.optimizers import STATE_LABELS

GiB = 1 << 30
MiB = 1 << 20


def _count(n: int) -> str:
    """134,515,008 -> "134.5M" (one decimal, as `jaxtune info`'s reader would round it)."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def mesh_label(mesh: dict) -> str:
    """"data=1 fsdp=8 tensor=1", with expert= and context= where those axes are used."""
    return " ".join(f"{axis}={size}" for axis, size in mesh.items()
                    if axis not in ("expert", "context") or size > 1)


def plan_dict(est: Estimate, time: StepTime | None = None, compiled: CompiledMemory | None = None) -> dict:
    """`est.to_dict()` with the predicted step time and, if given, XLA's compiled memory of the same plan."""
    out = est.to_dict()
    if time is not None:
        out["step"] = time.to_dict()
    if compiled is not None:
        out["compiled"] = {**compiled.to_dict(), "estimate_bytes": est.compiled_bytes,
                           "relative_error": est.compiled_bytes / compiled.total_bytes - 1}
    return out


def _describe(est: Estimate) -> list[str]:
    p, cfg, mesh = est.plan, est.model, est.mesh
    method = method_unit(p.method).label(p.method)
    added = est.parameters - est.base_parameters
    return [
        f"model: {_count(est.base_parameters)} parameters ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}){f'; the method adds {_count(added)}' if added else ''}; "
        f"trainable {est.trainable_parameters:,}",
        f"plan: {method}, {p.objective}; batch {p.batch_size} x {p.grad_accum} accumulation, sequence {p.seq_len}, "
        f"remat {p.forward.remat.policy}, compute {p.forward.compute_dtype}, weights {p.param_dtype}"
        f"{f', context attention {p.forward.context_attention}' if mesh['context'] > 1 else ''}",
        f"target: {est.device.count} x {est.device.name} (mesh {mesh_label(mesh)})"
        f"{', offload ' + _offload(est) if _offload(est) else ''}",
    ] + _images(est)


def _images(est: Estimate) -> list[str]:
    """The image side's line of a vision-language plan: its arrays, its frozen tower, its forward's moment."""
    images = est.plan.images
    if images is None:
        return []
    specs = jax.tree.leaves(images.family.param_specs(images.config), is_leaf=lambda x: isinstance(x, ParamSpec))
    forward = est.phases["image side"]["activations"]
    return [f"images: {images.family.name}, {images.max_images} pixel array(s) of {list(images.pixel_shape)} a row; "
            f"the frozen tower's {_count(sum(math.prod(s.shape) for s in specs))} parameters are in the frozen "
            f"weights, its forward {forward / MiB:,.2f} MiB a device (the image side's moment)"]


def _offload(est: Estimate) -> str:
    o = est.plan.offload
    parts = [name for name, on in (("optimizer state", o.optimizer_state), ("frozen weights", o.frozen_params)) if on]
    if o.moments_dtype != "float32":
        parts.append(f"moments in {o.moments_dtype}")
    return ", ".join(parts)


def format_compiled(confirmation) -> str:
    """What compiling the plan said (`compiled_search.Confirmation`): XLA's memory analysis of the compiled step
    beside the planner's figure for the same plan and backend; for a TPU slice also the compiler's verdict, FLOPs,
    bytes, collectives, the attention kernel it compiled and a modelled step time."""
    est, compiled = confirmation.estimate, confirmation.compiled
    if compiled is None:
        return f"not compiled: {confirmation.skipped}"
    scale, unit = (GiB, "GiB") if compiled.total_bytes >= GiB else (MiB, "MiB")
    c = {k: v / scale for k, v in compiled.to_dict().items() if k.endswith("_bytes")}
    where = f"{compiled.backend} compiler for {confirmation.topology}" if confirmation.topology else compiled.backend
    lines = [
        f"XLA ({where}, compiled in {compiled.compile_seconds:.1f} s, per device): arguments "
        f"{c['argument_bytes']:.3f} + temporaries {c['temp_bytes']:.3f} + outputs {c['output_bytes']:.3f} - aliased "
        f"{c['alias_bytes']:.3f} = {c['total_bytes']:.3f} {unit}",
        f"planner, the same plan on {est.device.target}, without the runtime reserve: {est.compiled_bytes / scale:.3f} "
        f"{unit} ({100 * (est.compiled_bytes / confirmation.peak_bytes - 1):+.1f}%"
        f"{' of the peak, the rollout' if confirmation.peak_bytes > compiled.total_bytes else ''})"]
    if confirmation.rollout is not None:
        lines.append(f"GRPO's rollout (one device): {confirmation.rollout.total_bytes / scale:.3f} {unit}, with the "
                     f"optimizer state beside it {confirmation.peak_bytes / scale:.3f} {unit} at the iteration's peak")
    if compiled.over_memory:
        lines.append(f"the {compiled.backend} compiler refused the program: its temporaries alone need "
                     f"{compiled.temp_bytes / GiB:.2f} GiB of the {compiled.over_memory / GiB:.2f} GiB a device has")
    if confirmation.topology:
        verdict = "fits" if confirmation.fits else "does NOT fit"
        model = confirmation.modelled_step()
        collectives = ", ".join(f"{op} x{v['count']} ({v['bytes'] / MiB:.1f} MiB)"
                                for op, v in sorted(compiled.collectives.items())) or "none"
        lines += [
            f"the compiler's verdict: {confirmation.peak_bytes / GiB:.2f} GiB + reserve "
            f"{confirmation.estimate.reserve_bytes / GiB:.2f} GiB of {est.device.usable_bytes / GiB:.2f} GiB usable: "
            f"{verdict}",
            f"program: {compiled.flops / 1e12:.3f} TFLOP of matmuls a device, loops by their trip counts (planner: "
            f"{model['planner_flops'] / 1e12:.3f}); attention kernel {compiled.attention}"
            f"{', experts by ' + compiled.grouped_matmul if compiled.grouped_matmul else ''}, remat "
            f"{est.plan.forward.remat.policy}; "
            f"collectives (each once, a loop body's too): {collectives}",
            f"modelled, not measured: {model['modelled_step_seconds'] * 1e3:.1f} ms a step at the chip's peak FLOP/s"]
    return "\n".join(lines)


def format_estimate(est: Estimate, time: StepTime | None = None) -> str:
    """The per-device breakdown as a table, with the step time when given."""
    d = est.device
    scale, unit = (GiB, "GiB") if est.total_bytes >= GiB else (MiB, "MiB")
    size = lambda n: f"{n / scale:.2f}"
    rows = [
        ("weights", est.weights_bytes, f"frozen {size(est.frozen_bytes)} + trainable float32 "
                                       f"{size(est.trainable_bytes)} + extra models {size(est.extra_models_bytes)}"),
        ("gradients", est.gradients_bytes, "float32, the copies alive at the peak"),
        ("optimizer", est.optimizer_bytes, STATE_LABELS[est.plan.optimizer] + (" (in host memory between steps)"
                                                                             if est.plan.offload.optimizer_state
                                                                             else "")),
        ("activations", est.activations_bytes, f"saved {size(est.saved_activations_bytes)} + attention "
                                               f"{size(est.attention_bytes)} + logits {size(est.logits_bytes)}"
                                               f" + {'update' if est.peak_phase == 'update' else 'backward'} "
                                               f"workspace {size(est.workspace_bytes)}"),
        ("other", est.other_bytes, f"weight copies {size(est.weight_copies_bytes)} + KV cache "
                                   f"{size(est.kv_cache_bytes)} + batch {size(est.batch_bytes)} + reserve "
                                   f"{size(est.reserve_bytes)}"),
    ]
    lines = _describe(est) + ["", f"  {'per device':<12}{unit:>10}"]
    lines += [f"  {name:<12}{size(value):>10}   {detail}" for name, value, detail in rows]
    verdict = "fits" if est.fits else "does NOT fit"
    lines.append(f"  {'total':<12}{size(est.total_bytes):>10}   of {d.usable_bytes / GiB:.2f} GiB usable "
                 f"({d.memory_bytes / GiB:.0f} GiB x {d.usable_fraction}): {verdict}")
    transient = ", ".join(f"{k} {size(v['total'])}" for k, v in est.phases.items())
    lines.append(f"  peak in the {est.peak_phase} (transient {unit} by moment: {transient})")
    larger = ("above the step's peak, so the verdict is on it" if est.loading_bytes > est.total_bytes
              else "below the step's peak")
    lines.append(f"  loading: {size(est.loading_bytes)} {unit} at its peak ({size(est.loading_transient_bytes)} of "
                 f"read and quantisation buffers beside the arrays it creates), {larger}")
    if est.host_bytes:
        lines.append(f"  host memory: {est.host_bytes / GiB:.2f} GiB a device")
    if time is not None:
        lines.append(f"  step: {time.step_s:.3g} s, {time.tokens_per_s:,.0f} tokens/s, {time.bound}-bound "
                     f"(compute {time.compute_s:.3g} s, memory {time.memory_s:.3g} s, communication "
                     f"{time.comm_s:.3g} s a micro-batch)")
    lines += [f"  note: {n}" for n in est.notes]
    return "\n".join(lines)


def format_search(result: SearchResult, top: int = 3) -> str:
    """The best `top` fitting plans with why they win, or the smallest change that would make one fit."""
    if not result.candidates:
        assert result.suggestion is not None  # a search that found no plan says what would fit, or that nothing did
        lines = [f"no plan fits ({result.tried} tried)."]
        lines.append(f"smallest change that fits: {result.suggestion}" if result.suggested is not None
                     else result.suggestion)
        if result.suggested is not None:
            lines += ["", format_estimate(result.suggested.estimate, result.suggested.time)]
        return "\n".join(lines)
    lines = [f"{len(result.candidates)} of {result.tried} plans fit; the fastest:"]
    for i, c in enumerate(result.candidates[:top], 1):
        p, m = c.plan, c.estimate.mesh
        lines += ["", f"#{i}: batch {p.batch_size} x {p.grad_accum}, remat {p.forward.remat.policy}, "
                      f"mesh {mesh_label(m)}"
                      + (f", {method_unit(p.method).label(p.method)}" if method_unit(p.method).costs.searched else "")
                      + (", optimizer state in host memory" if p.offload.optimizer_state else "")]
        lines += [f"    {line}" for line in explain(c, result.candidates)]
    return "\n".join(lines)


def longest_context_dict(result: LongestContext) -> dict:
    """The numbers of `longest_context`'s answer; `limit` says what stops it: "memory" or "model context"."""
    leanest = result.leanest_too_long
    return {"seq_len": result.seq_len, "limit": "model context" if result.too_long is None else "memory",
            "too_long": result.too_long, "too_long_peak_bytes": leanest.peak_bytes if leanest else None,
            "usable_bytes": result.fastest.estimate.device.usable_bytes, "context": result.context,
            "lengths_searched": result.lengths_searched}


def format_longest_context(result: LongestContext) -> str:
    """One line: the longest context that fits, its plan and what stops it; then why that plan."""
    c = result.fastest
    p, device = c.plan, c.estimate.device
    m = c.estimate.mesh
    choices = [method_unit(p.method).label(p.method), f"batch {p.batch_size} x {p.grad_accum}",
               f"remat {p.forward.remat.policy}"]
    if device.count > 1:
        choices.append(f"mesh {mesh_label(m)}")
    if p.offload.optimizer_state:
        choices.append("optimizer state in host memory")
    if result.too_long is None or result.leanest_too_long is None:  # both None together
        limit = f"the model's own context, {result.context:,} tokens (max_position_embeddings), is the limit"
    else:
        limit = (f"{result.too_long:,} does not fit ({result.leanest_too_long.peak_bytes / GiB:.2f} GiB needed, "
                 f"{device.usable_bytes / GiB:.2f} GiB usable)")
    line = f"longest context that fits {device.target}: {result.seq_len:,} tokens ({', '.join(choices)}); {limit}"
    return "\n".join([line] + [f"    {why}" for why in explain(c)])
