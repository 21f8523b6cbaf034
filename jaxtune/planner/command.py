"""`jaxtune plan` as one function: from the command line's values to the report (text or a JSON-ready dict).

    result = run_plan(params=7000, method="full", target="h100-80gb-8", batch=8, seq=2048)
    result["per_device"]["total_bytes"], result["fits"]

The CLI parses arguments and calls `run_plan` and `render`; a notebook can call them with the same values.
`make_plan` turns the values into (config, plan, device), `compiled_search.confirm_plan` compiles the plan's step for
the target (a TPU slice's from its topology, `planner/slices.py`); `suggestion_for_run` is `train`'s OOM advice.
"""

from __future__ import annotations

import os

import jax

from jaxtune.config import ForwardOptions, MeshConfig, ModelConfig, OffloadConfig, Remat
from jaxtune.config.plan import TrainPlan
from jaxtune.config.run import batch_ways
from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.methods import method_config, option_names
from jaxtune.models.vision.families import image_side
from jaxtune.objectives import objective_named
from jaxtune.parallel.mesh import MESH_AXES
from jaxtune.planner.compiled_search import confirm_plan, format_bound, largest_accepted
from jaxtune.planner.devices import Device, get_device
from jaxtune.planner.estimate import estimate, resolve_mesh
from jaxtune.planner.report import (
    format_compiled,
    format_estimate,
    format_longest_context,
    format_search,
    longest_context_dict,
    plan_dict,
)
from jaxtune.planner.search import longest_context, search
from jaxtune.planner.shapes import model_from_directory, standard_config
from jaxtune.planner.timing import step_time
from jaxtune.run_config import load_run_config, with_local_models
from jaxtune.spine import run as spine_run

OFFLOAD_CHOICES = ("optimizer", "params", "moments-bf16")


def parse_mesh(text: str | None) -> MeshConfig | None:
    """"data=2,fsdp=4,tensor=1" (or expert=E, context=C) or "2x4x1" (data x fsdp x tensor; four sizes: data x fsdp x
    expert x tensor) -> MeshConfig; axes left out are 1, fsdp takes the rest (-1)."""
    if not text:
        return None
    try:
        if "=" in text:
            sizes = {}
            for part in text.split(","):
                name, _, value = part.partition("=")
                name = name.strip()
                if name not in MESH_AXES:
                    raise JaxtuneError(f"--mesh {text!r}: unknown axis {name!r}; axes: {', '.join(MESH_AXES)}")
                sizes[name] = int(value)
            return MeshConfig(**sizes)
        values = [int(v) for v in text.lower().split("x")]
        if len(values) not in (3, 4):
            raise ValueError(f"{len(values)} sizes")
        names = ("data", "fsdp", "tensor") if len(values) == 3 else ("data", "fsdp", "expert", "tensor")
        return MeshConfig(**dict(zip(names, values)))
    except (ValueError, TypeError) as e:
        raise JaxtuneError(f"--mesh {text!r}: expected data=D,fsdp=F,tensor=T (expert=E, context=C) or DxFxT ({e})"
                           ) from None


def parse_offload(items) -> OffloadConfig:
    items = [i for item in (items or ()) for i in item.split(",") if i]
    unknown = [i for i in items if i not in OFFLOAD_CHOICES]
    if unknown:
        raise JaxtuneError(f"--offload {unknown[0]!r}: choose from {', '.join(OFFLOAD_CHOICES)}")
    return OffloadConfig("optimizer" in items, "params" in items, "bfloat16" if "moments-bf16" in items else "float32")


def make_plan(*, model: str | None = None, params: float | None = None, config: str | None = None,
              method: str = "lora", target: str = "cpu",
              batch: int | None = None, seq: int = 512, accum: int = 1, remat: str | None = None,
              mesh: str | None = None,
              offload=(), rank: int = 16, bits: int = 4, targets: str = "all-linear",
              compute_dtype: str | None = None, param_dtype: str | None = None, objective: str = "sft",
              generate_tokens: int = 0, context_attention: str = "ring",
              images: int = 1, tiled_mlp: int = 0) -> tuple[ModelConfig, TrainPlan, Device]:
    """(model config, plan, device) from the values `jaxtune plan` takes. Exactly one of `model` (a Hugging Face
    directory), `params` (millions, for a standard Llama shape) or `config` (a `jaxtune train` TOML, which then
    gives every other value) names the model. `batch` (rows per micro-batch
    over all devices) defaults to one row per data x fsdp device. `images`: pixel arrays a batch row holds when
    `model` is a vision-language directory (`data.max_images_per_row`), its image side then in the plan."""
    if sum(x is not None for x in (model, params, config)) != 1:
        raise JaxtuneError("give exactly one of --model DIR, --params MILLIONS or --config RUN.toml")
    device = get_device(target)
    if config is not None:
        cfg, plan = plan_from_run_config(load_run_config(config), device.family)
        if compute_dtype is not None:
            plan = plan.replace(compute_dtype=compute_dtype)
        return cfg, plan, device
    unit = objective_named(objective)
    objective = unit.name
    if images < 1:
        raise JaxtuneError(f"--images {images}: a vision-language row holds at least 1 image")
    if model is not None:
        cfg, stored = model_from_directory(model)
    else:
        assert params is not None  # exactly one of the three, checked above
        cfg, stored = standard_config(params), ("bfloat16" if device.family != "cpu" else "float32")
    accelerator = device.family != "cpu"
    try:
        values = {"rank": rank, "alpha": 2.0 * rank, "bits": bits, "target_modules": tuple(targets.split(","))}
        method_cfg = method_config(method, **{k: v for k, v in values.items() if k in option_names(method)})
        mesh_cfg = parse_mesh(mesh) or MeshConfig()
        if batch is None:
            batch = batch_ways(resolve_mesh(mesh_cfg, device))
        plan = TrainPlan(method_cfg, batch, seq, accum, param_dtype=param_dtype or stored,
                         forward=ForwardOptions(compute_dtype or ("bfloat16" if accelerator else "float32"),
                                                Remat(remat or "none"), context_attention=context_attention,
                                                tiled_mlp=tiled_mlp),
                         mesh=mesh_cfg, offload=parse_offload(offload), objective=objective,
                         generate_tokens=generate_tokens,
                         images=image_side(model, images) if model is not None and unit.reads_images else None)
    except ConfigError:
        raise
    except ValueError as e:
        raise JaxtuneError(str(e)) from None
    return cfg, plan, device


def plan_from_run_config(config, platform: str | None = None) -> tuple[ModelConfig, TrainPlan]:
    """(model config, plan) of a `RunConfig` (`jaxtune train`'s TOML): exactly the plan `fine_tune` runs on
    `platform`'s devices (default this host's), its objective, the objective's section and second model included
    (`spine.run.train_plan`)."""
    if not config.model.path:
        raise JaxtuneError("[model] path is not set")
    config = with_local_models(config)  # Hub ids as their cached snapshots
    cfg, stored = model_from_directory(config.model.path)
    return cfg, spine_run.train_plan(config, stored, platform)


def run_plan(*, search_plans: bool = False, longest: bool = False, step: int = 256, confirm: bool = False,
             top: int = 3, **values) -> dict:
    """The JSON object `jaxtune plan --json` prints: the plan's (or the best found plan's) per-device breakdown,
    device and `fits`; with search, the `candidates` and, when none fits, the `suggestion`; with longest, the
    `longest_context` (multiples of `step` tokens) and the breakdown of its fastest plan; with confirm, XLA's
    `compiled` memory beside the estimate."""
    if confirm and get_device(values.get("target", "cpu")).family == "cpu":
        _fake_cpu_devices(get_device(values.get("target", "cpu")).count)
    cfg, plan, device = make_plan(**values)
    fixed = tuple(name for name, given in (("remat", values.get("remat")), ("mesh", values.get("mesh")),
                                           ("offload", values.get("offload"))) if given)
    if longest:
        found = longest_context(cfg, plan, device, step, fixed)
        out = plan_dict(found.fastest.estimate, found.fastest.time)
        out["_estimate"] = (found.fastest.estimate, found.fastest.time)
        out["longest_context"] = longest_context_dict(found)
        out["_longest"] = found
    elif search_plans:
        result = search(cfg, plan, device, plan.global_batch, fixed)
        if result.candidates:
            best = result.candidates[0]
            out = plan_dict(best.estimate, best.time)
            out["_estimate"] = (best.estimate, best.time)
        else:
            est = estimate(cfg, plan, device)
            time = step_time(est)
            out = plan_dict(est, time)
            out["_estimate"] = (est, time)
            out["suggestion"] = result.suggestion
            if result.suggested is not None:
                out["suggested"] = plan_dict(result.suggested.estimate, result.suggested.time)
        out["candidates"] = [plan_dict(c.estimate, c.time) for c in result.candidates[:top]]
        out["tried"] = result.tried
        out["_search"] = result
    else:
        est = estimate(cfg, plan, device)
        time = step_time(est)
        out = plan_dict(est, time)
        out["_estimate"] = (est, time)
    if confirm:
        chosen = out["_estimate"][0].plan  # the plan reported: given, or the best found
        chosen = chosen.replace(mesh=MeshConfig(**resolve_mesh(chosen.mesh, device)))  # the target's device count
        if device.family == "tpu" and (longest or search_plans):
            out.update(_search_with_compiler(cfg, chosen, device, out, step, top, longest))
        else:
            confirmation = confirm_plan(cfg, chosen, device)
            out["compiled"] = confirmation.to_dict()
            out["_confirm"] = confirmation
    return out


def _search_with_compiler(cfg: ModelConfig, chosen: TrainPlan, device, out: dict, step: int, top: int,
                          longest: bool) -> dict:
    """`--longest-context --confirm` on a TPU slice: the longest context its compiler accepts for the fastest plan,
    bisected from the planner's in multiples of `step`. `--search --confirm`: the best of the first `top`
    candidates the compiler accepts, then the largest batch it accepts for that plan (multiples of the rows a
    batch is split into)."""
    found: dict = {}
    if longest:
        bound = largest_accepted(cfg, chosen, device, "seq_len", chosen.seq_len, step, cfg.max_position_embeddings)
    else:
        plans = [c.estimate.plan for c in out["_search"].candidates[:top]] or [chosen]
        for plan in plans:
            plan = plan.replace(mesh=MeshConfig(**resolve_mesh(plan.mesh, device)))
            confirmation = confirm_plan(cfg, plan, device)
            found.setdefault("compiled_candidates", []).append(confirmation.to_dict())
            if confirmation.fits:
                chosen = plan
                break
        ways = batch_ways(resolve_mesh(chosen.mesh, device))
        bound = largest_accepted(cfg, chosen, device, "batch_size", chosen.batch_size, ways,
                                 max(ways, 8 * chosen.batch_size))
    found.update({"compiled": bound.confirmation.to_dict(), "_confirm": bound.confirmation,
                  "compiled_bound": bound.to_dict(), "_bound": bound})
    return found


def _fake_cpu_devices(count: int) -> None:
    """Ask for `count` fake CPU devices (for compiling a sharded plan on CPU). XLA reads the flag when the CPU backend
    starts, so this must run before anything touches JAX's backends; accelerators ignore it."""
    if count > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={count}").strip()


def render(result: dict) -> str:
    """The text `jaxtune plan` prints for a `run_plan` result."""
    if "_longest" in result:
        text = format_longest_context(result["_longest"])
    elif "_search" in result:
        text = format_search(result["_search"])
    else:
        text = format_estimate(*result["_estimate"])
    if "_confirm" in result:
        text += "\n\n" + format_compiled(result["_confirm"])
    if "_bound" in result:
        text += "\n" + format_bound(result["_bound"], result["_confirm"].topology)
    return text


def public(result: dict) -> dict:
    """`result` without the Python objects kept for rendering."""
    return {k: v for k, v in result.items() if not k.startswith("_")}


def suggestion_for_run(config_path: str, overrides: list[str]) -> str:
    """What to change when `jaxtune train CONFIG` ran out of memory on this machine's CPU devices: what to lower,
    and the fastest plan the planner's search finds that fits (accelerators: the command that finds it)."""
    config = load_run_config(config_path, overrides)
    advice = (f"lower train.batch_size (now {config.train.batch_size}) or data.max_seq_len (now "
              f"{config.data.max_seq_len}), or set model.remat = \"full\"")
    command = f"jaxtune plan --config {config_path} --target TARGET --search"
    if jax.default_backend() != "cpu":
        return f"{advice}; `{command}` finds a plan that fits"
    try:
        cfg, plan = plan_from_run_config(config)
        device = get_device(f"cpu-{len(jax.devices())}" if len(jax.devices()) > 1 else "cpu")
        result = search(cfg, plan, device, plan.global_batch, ())
    except JaxtuneError:
        return f"{advice}; `{command}` finds a plan that fits"
    if not result.candidates:
        return f"{advice}; the planner finds no plan that fits this machine ({result.suggestion})"
    best = result.candidates[0].plan
    return (f"{advice}; the planner's fastest plan that fits ({command.replace('TARGET', device.target)}): "
            f"train.batch_size = {best.batch_size}, train.grad_accum = {best.grad_accum}, model.remat = "
            f"\"{best.forward.remat.policy}\"" + (", with optimizer offload" if best.offload.optimizer_state else ""))
