"""`jaxtune plan` as one function: from the command line's values to the report (text or a JSON-ready dict).

    result = run_plan(params=7000, method="full", target="h100-80gb-8", batch=8, seq=2048)
    result["per_device"]["total_bytes"], result["fits"]

The CLI parses arguments and calls `run_plan` and `render`; a notebook can call them with the same values.
"""

from __future__ import annotations

import os

from jaxtune.config import MethodConfig, ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.parallel.mesh import MESH_AXES, MeshConfig
from jaxtune.parallel.offload import OffloadConfig
from jaxtune.planner.devices import Device, get_device
from jaxtune.planner.estimate import estimate
from jaxtune.planner.plan import TrainPlan
from jaxtune.planner.report import format_compiled, format_estimate, format_search, plan_dict
from jaxtune.planner.search import search
from jaxtune.planner.shapes import model_from_directory, standard_config
from jaxtune.planner.timing import step_time

OFFLOAD_CHOICES = ("optimizer", "params", "moments-bf16")


def parse_mesh(text: str | None) -> MeshConfig | None:
    """"data=2,fsdp=4,tensor=1" (axes left out are 1, or -1 for the rest) or "2x4x1" -> MeshConfig."""
    if not text:
        return None
    try:
        if "=" in text:
            sizes = {axis: 1 for axis in MESH_AXES}
            for part in text.split(","):
                name, _, value = part.partition("=")
                name = name.strip()
                if name not in MESH_AXES:
                    raise JaxtuneError(f"--mesh {text!r}: unknown axis {name!r}; axes: {', '.join(MESH_AXES)}")
                sizes[name] = int(value)
            return MeshConfig(**sizes)
        return MeshConfig(*[int(v) for v in text.lower().split("x")])
    except (ValueError, TypeError) as e:
        raise JaxtuneError(f"--mesh {text!r}: expected data=D,fsdp=F,tensor=T or DxFxT ({e})") from None


def parse_offload(items) -> OffloadConfig:
    items = [i for item in (items or ()) for i in item.split(",") if i]
    unknown = [i for i in items if i not in OFFLOAD_CHOICES]
    if unknown:
        raise JaxtuneError(f"--offload {unknown[0]!r}: choose from {', '.join(OFFLOAD_CHOICES)}")
    return OffloadConfig("optimizer" in items, "params" in items, "bfloat16" if "moments-bf16" in items else "float32")


def make_plan(*, model: str | None = None, params: float | None = None, method: str = "lora", target: str = "cpu",
              batch: int = 1, seq: int = 512, accum: int = 1, remat: str | None = None, mesh: str | None = None,
              offload=(), rank: int = 16, bits: int = 4, targets: str = "all-linear",
              compute_dtype: str | None = None, param_dtype: str | None = None, objective: str = "sft",
              generate_tokens: int = 0) -> tuple[ModelConfig, TrainPlan, Device]:
    """(model config, plan, device) from the values `jaxtune plan` takes. Exactly one of `model` (a Hugging Face
    directory) or `params` (millions, for a standard Llama shape) names the model."""
    if (model is None) == (params is None):
        raise JaxtuneError("give exactly one of --model DIR or --params MILLIONS")
    device = get_device(target)
    if model is not None:
        cfg, stored = model_from_directory(model)
    else:
        cfg, stored = standard_config(params), "bfloat16"
    accelerator = device.family != "cpu"
    try:
        method_cfg = MethodConfig(method, rank=rank, alpha=2.0 * rank, bits=bits,
                                  target_modules=tuple(targets.split(",")) if method in ("lora", "qlora") else ())
        plan = TrainPlan(method_cfg, batch, seq, accum, remat or "none",
                         compute_dtype or ("bfloat16" if accelerator else "float32"), param_dtype or stored,
                         mesh=parse_mesh(mesh) or MeshConfig(), offload=parse_offload(offload), objective=objective,
                         generate_tokens=generate_tokens)
    except ValueError as e:
        raise JaxtuneError(str(e)) from None
    return cfg, plan, device


def run_plan(*, search_plans: bool = False, confirm: bool = False, top: int = 3, **values) -> dict:
    """The JSON object `jaxtune plan --json` prints: the plan's (or the best found plan's) per-device breakdown,
    device and `fits`; with search, the `candidates` and, when none fits, the `suggestion`; with confirm, XLA's
    `compiled` memory beside the estimate."""
    cfg, plan, device = make_plan(**values)
    if search_plans:
        fixed = tuple(name for name, given in (("remat", values.get("remat")), ("mesh", values.get("mesh")),
                                               ("offload", values.get("offload"))) if given)
        result = search(cfg, plan, device, plan.global_batch, fixed)
        if result.candidates:
            best = result.candidates[0]
            out = plan_dict(best.estimate, best.time)
            out["_estimate"] = (best.estimate, best.time)
        else:
            est = estimate(cfg, plan, device)
            out = plan_dict(est, step_time(est))
            out["_estimate"] = (est, step_time(est))
            out["suggestion"] = result.suggestion
            if result.suggested is not None:
                out["suggested"] = plan_dict(result.suggested.estimate, result.suggested.time)
        out["candidates"] = [plan_dict(c.estimate, c.time) for c in result.candidates[:top]]
        out["tried"] = result.tried
        out["_search"] = result
    else:
        est = estimate(cfg, plan, device)
        out = plan_dict(est, step_time(est))
        out["_estimate"] = (est, step_time(est))
    if confirm:
        chosen = out["_search"].candidates[0].plan if search_plans and out["_search"].candidates else plan
        compiled, backend_est = confirm_plan(cfg, chosen)
        out["compiled"] = {**compiled.to_dict(), "estimate_bytes": backend_est.compiled_bytes,
                           "estimate_device": backend_est.device.target,
                           "relative_error": backend_est.compiled_bytes / compiled.total_bytes - 1}
        out["_confirm"] = (compiled, backend_est)
    return out


def confirm_plan(cfg: ModelConfig, plan: TrainPlan):
    """(XLA's compiled memory of the real step on this backend, the estimate of the same plan for this backend)."""
    import jax

    from jaxtune.planner.confirm import compile_step

    n = plan.mesh.sizes()
    count = max(1, abs(n["data"] * n["fsdp"] * n["tensor"]))
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "") and count > 1:
        # fake CPU devices for a sharded plan; read when the CPU backend starts, ignored by accelerators
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={count}").strip()
    backend = jax.default_backend()
    devices = jax.devices()
    if -1 in n.values():
        count = len(devices)
    here = get_device(f"cpu-{count}" if count > 1 else "cpu") if backend == "cpu" else None
    compiled = compile_step(cfg, plan, devices[:count] if count <= len(devices) else devices)
    if here is None:
        family = {"gpu": "h100-80gb", "cuda": "h100-80gb", "rocm": "h100-80gb", "tpu": "v5p"}.get(backend, "cpu")
        here = get_device(family).with_count(count)
    return compiled, estimate(cfg, plan, here)


def render(result: dict) -> str:
    """The text `jaxtune plan` prints for a `run_plan` result."""
    text = format_search(result["_search"]) if "_search" in result else format_estimate(*result["_estimate"])
    if "_confirm" in result:
        text += "\n\n" + format_compiled(*result["_confirm"])
    return text


def public(result: dict) -> dict:
    """`result` without the Python objects kept for rendering."""
    return {k: v for k, v in result.items() if not k.startswith("_")}
