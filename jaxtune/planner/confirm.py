"""Ahead-of-time confirmation: compile the real train step for a plan and read XLA's memory analysis
(`compile_step -> CompiledMemory`; GRPO's rollout: `compile_rollout`; the larger of both: `compile_peak`).

Nothing is allocated: the step and its arguments are the spine's abstract run (`spine/run.py`), the very step and
ShapeDtypeStructs the trainer uses, and `jit(...).lower(...).compile()` plans buffers without running; the rollout
is `generation.decode` lowered the same way. XLA's figure for one device is arguments + temporaries + outputs -
aliased (donated state comes back in place); the HLO also tells the kernels and collectives it chose.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxtune.config import ForwardOptions, MeshConfig, ModelConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.errors import JaxtuneError
from jaxtune.generation import decode, decode_arguments
from jaxtune.methods.base import method_unit
from jaxtune.methods.transform import combine
from jaxtune.models import grouped_tiles
from jaxtune.objectives import rows as rows_of
from jaxtune.parallel.mesh import make_mesh
from jaxtune.parallel.rules import PLATFORMS
from jaxtune.planner.program_flops import step_flops
from jaxtune.spine.run import abstract_run, per_device_bytes, traced_on


@dataclass(frozen=True)
class CompiledMemory:
    """XLA's per-device memory analysis of the compiled step, in bytes, and what else the program says: its matmul
    FLOPs a device (`program_flops.py`: loops by their trip counts), XLA's own FLOPs and bytes accessed a device
    (`cost_analysis`, which counts a loop body once: about one layer of a scanned model), its collectives ({op:
    {"count", "bytes"}}: each op as often as the program text has it, a loop body's once, and the bytes it
    produces), the attention kernel in it ("splash", "cudnn" or "blockwise"), a mixture's grouped matmul ("megablox",
    "tiles", "ragged_dot"; "" without experts), the platform it was compiled for and
    how long that took. A program the compiler refused for want of memory (the TPU compiler checks each chip's HBM)
    has `over_memory`, the memory it had, and its temporaries as the compiler counted them."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    host_bytes: int
    backend: str
    compile_seconds: float
    flops: float = 0.0
    xla_flops: float = 0.0
    xla_bytes_accessed: float = 0.0
    collectives: dict = field(default_factory=dict)
    attention: str = "blockwise"
    grouped_matmul: str = ""
    over_memory: int = 0  # > 0: the compiler refused the program, over this many bytes of device memory

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}


def _mesh(plan: TrainPlan, devices):
    available = list(jax.devices() if devices is None else devices)
    sizes = plan.mesh.resolve(len(available)) if -1 in plan.mesh.sizes().values() else plan.mesh.sizes()
    needed = math.prod(sizes.values())
    if needed > len(available):
        hint = (f"; on CPU run with XLA_FLAGS=--xla_force_host_platform_device_count={needed}"
                if jax.default_backend() == "cpu" else "")
        raise JaxtuneError(f"the plan's mesh needs {needed} devices, this {jax.default_backend()} backend has "
                           f"{len(available)}{hint}")
    return make_mesh(MeshConfig(**sizes, slices=plan.mesh.slices), available[:needed])


def compile_step(cfg: ModelConfig, plan: TrainPlan, devices=None) -> CompiledMemory:
    """Compile the trainer's own step for `plan` and return XLA's per-device memory analysis (and what else
    `CompiledMemory` holds).

    The step is the spine's (`spine.run.abstract_run(...).step`): the objective's loss, accumulation and update in
    one jit with the run's shardings, offload memory kinds and donation. devices: the devices of the mesh (default:
    the first `mesh size` of `jax.devices()`; on CPU, fake ones come from
    XLA_FLAGS=--xla_force_host_platform_device_count=N; a TPU slice's from `planner.slices.topology_devices`, on any
    host: the TPU compiler then compiles it, with the kernels a TPU runs). GRPO's rollout is a program of its own:
    `compile_rollout`.
    """
    mesh = _mesh(plan, devices)
    run = abstract_run(cfg, plan, mesh)
    start = time.perf_counter()
    with _cache_for(mesh):
        try:
            compiled = run.step.lower(run.state, run.frozen, run.second, run.batch).compile()
        except Exception as e:  # noqa: BLE001 - the TPU compiler refuses a program over the chip's HBM
            refused = _over_memory(e, run, time.perf_counter() - start, _platform(mesh))
            if refused is None:
                raise
            return refused
    seconds = time.perf_counter() - start
    return _memory(compiled, seconds, _platform(mesh), step_flops(run) / mesh.size)


_HBM = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)")


def _over_memory(error: Exception, run, seconds: float, platform: str) -> CompiledMemory | None:
    """What the TPU compiler says when it refuses a step over the chip's memory ("the total memory required for
    HLO temporaries (20.05G) exceeds available HBM (15.75G)"): its temporaries, beside the step's arguments, with
    `over_memory` set; None for any other error."""
    found = _HBM.search(str(error))
    if found is None:
        return None
    scale = lambda unit: {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit]
    temps, available = (int(float(found[i]) * scale(found[i + 1])) for i in (1, 3))
    arguments = per_device_bytes((run.state, run.frozen, run.second, run.batch))
    return CompiledMemory(arguments, 0, 0, temps, 0, platform, seconds, over_memory=available)


@contextmanager
def _cache_for(mesh):
    """Compiling for another platform than this host's (a TPU slice from its topology), JAX's persistent compilation
    cache (where one is set) stores the program but cannot read it back without that platform's devices: its
    warning saying so is dropped."""
    with warnings.catch_warnings():
        if _platform(mesh) != jax.default_backend():
            warnings.filterwarnings("ignore", message="Error reading persistent compilation cache entry")
        yield


def _platform(mesh) -> str:
    platform = mesh.devices.flat[0].platform
    return PLATFORMS.get(platform, platform)


def compile_rollout(cfg: ModelConfig, plan: TrainPlan, devices=None) -> CompiledMemory:
    """XLA's memory of GRPO's rollout per device: jaxtune's generation program (prefill, then a `while_loop` of
    cached decode steps) sampling `plan.generate_tokens` tokens after prompts of `seq_len - generate_tokens` for
    all `rows x grad_accum` rows of an optimizer step at once (as the trainer does), from the policy's weights as
    the step holds them (float32 trainable masters + the frozen base). devices: None for one device of this
    backend; else the plan's mesh of them (a TPU slice's), the weights split as the run splits them and the prompts
    on every device, as the trainer's rollout on a mesh runs. The optimizer state, alive beside it but not an
    argument, is not in this figure."""
    if plan.generate_tokens < 1:
        raise JaxtuneError("a rollout needs generate_tokens of at least 1 (objective grpo)")
    mesh = _mesh(plan.replace(mesh=MeshConfig(fsdp=1)), None) if devices is None else _mesh(plan, devices)
    run = abstract_run(cfg, plan, mesh)
    state, frozen = run.state, run.frozen
    rows, prompt = rows_of(plan) * plan.grad_accum, plan.seq_len - plan.generate_tokens
    prefix = method_unit(plan.method).costs.attended_tokens(plan.method)
    on_mesh = NamedSharding(mesh, PartitionSpec())  # the prompts and sampling values on every device
    options = ForwardOptions(compute_dtype=plan.forward.compute_dtype, attention=plan.forward.attention)  # a decode
    start = time.perf_counter()
    with traced_on(mesh), _cache_for(mesh):
        compiled = decode.lower(
            combine(state["params"], frozen), *decode_arguments(rows, prompt, cfg.vocab_size, on_mesh), cfg=cfg,
            method=plan.method, options=options, cache_size=prefix + plan.seq_len,
            max_new_tokens=plan.generate_tokens, greedy=False).compile()
    return _memory(compiled, time.perf_counter() - start, _platform(mesh))


def compile_peak(cfg: ModelConfig, plan: TrainPlan) -> tuple[int, str]:
    """(XLA's per-device bytes at the training iteration's peak, "step" or "rollout"): the step's total, or for
    GRPO with a rollout the larger of it and the rollout's total + the optimizer state (alive beside the generation
    program but not one of its arguments)."""
    step = compile_step(cfg, plan).total_bytes
    if not plan.generate_tokens:
        return step, "step"
    state = abstract_run(cfg, plan, _mesh(plan.replace(mesh=MeshConfig(fsdp=1)), None)).state
    optimizer = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["opt_state"]))
    rollout = compile_rollout(cfg, plan).total_bytes + optimizer
    return (step, "step") if step >= rollout else (rollout, "rollout")


def _memory(compiled, seconds: float, platform: str, flops: float = 0.0) -> CompiledMemory:
    m = compiled.memory_analysis()
    if m is None:
        raise JaxtuneError(f"the {platform} compiler gives no memory analysis for compiled programs")
    host = m.host_argument_size_in_bytes + m.host_temp_size_in_bytes + m.host_output_size_in_bytes \
        - m.host_alias_size_in_bytes
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    return CompiledMemory(m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                          m.temp_size_in_bytes, host, platform, seconds, flops, float(cost.get("flops", 0.0)),
                          float(cost.get("bytes accessed", 0.0)), collectives(text), attention_kernel(text),
                          grouped_matmul_kernel(text))


COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_OP = re.compile(r"= (?P<type>[^=]*?) (?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64)\[([0-9,]*)\]")
_BITS = {"pred": 8, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32,
         "s64": 64, "u64": 64, "f64": 64}


def collectives(hlo: str) -> dict:
    """{op: {"count", "bytes"}} of the collectives in an optimised HLO module's text: each instruction once (a loop
    body's too), its bytes those of the largest array it produces (an async start's output)."""
    found: dict = {}
    for match in _OP.finditer(hlo):
        sizes = [math.prod(int(d) for d in dims.split(",") if d) * _BITS[kind] // 8
                 for kind, dims in _SHAPE.findall(match["type"])]
        entry = found.setdefault(match["op"], {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += max(sizes, default=0)
    return found


def attention_kernel(hlo: str) -> str:
    """The attention kernel a compiled program runs: Pallas splash (a TPU custom call of that name), cuDNN's fused
    attention, or jaxtune's blockwise kernel (plain HLO)."""
    if "splash" in hlo and ("tpu_custom_call" in hlo or "mosaic" in hlo.lower()):
        return "splash"
    if "__cudnn$fmha" in hlo:
        return "cudnn"
    return "blockwise"


def grouped_matmul_kernel(hlo: str) -> str:
    """A mixture's grouped matmul in a compiled program: Pallas megablox (TPU custom calls `gmm`, `tgmm`), the
    tiles of `models.grouped_tiles` (its ops named by its scope), `lax.ragged_dot` (dense per expert on TPU), or ""
    (no mixture)."""
    if re.search(r"%t?gmm[.\d]* = [^\n]*custom-call", hlo):
        return "megablox"
    if grouped_tiles.SCOPE in hlo:
        return "tiles"
    return "ragged_dot" if "ragged-dot" in hlo or "ragged_dot" in hlo else ""
