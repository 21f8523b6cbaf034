"""The FLOPs a compiled step runs (`step_flops(run)`, `jaxpr_flops`), counted from the program JAX traces, loops by
their trip counts.

XLA's `cost_analysis()` counts a while loop's body once, so for a scanned model it gives about one layer's work.
The jaxpr knows every loop's length: a `dot_general` counts 2 x its output elements x its contracted size, a `scan`
its body times its length, a `cond` its costliest branch, a Pallas kernel its body times its grid (splash attention
only its blocks that run; megablox each row once), a `shard_map` its body on every device. Dead code goes first, as
XLA drops it (a LoRA step's jaxpr holds every frozen weight's gradient). What the backward and rematerialisation
recompute is in the traced step already; the count is of the whole program, over all devices.
"""

from __future__ import annotations

import math

import jax
from jax.extend import core

# primitives whose sub-jaxprs run once per call (their parameters holding a jaxpr under one of these names)
_SUBJAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def jaxpr_flops(jaxpr) -> float:
    """Matmul FLOPs of a (closed) jaxpr, loops included by their trip counts."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return sum(_eqn_flops(eqn) for eqn in jaxpr.eqns)


def _eqn_flops(eqn) -> float:
    name, params = eqn.primitive.name, eqn.params
    if name == "dot_general":
        (lhs_contract, _), _ = params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
    if name == "ragged_dot_general" or name == "ragged_dot":  # grouped matmuls: each row once, as a dense one would
        lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
        return 2.0 * math.prod(eqn.outvars[0].aval.shape) * lhs[-1] if len(rhs) else 0.0
    if name == "scan":
        return params["length"] * jaxpr_flops(params["jaxpr"])
    if name == "while":
        return jaxpr_flops(params["body_jaxpr"])  # a trip count JAX does not know: once
    if name == "cond":
        return max(jaxpr_flops(branch) for branch in params["branches"])
    if name == "pallas_call":
        if _is_megablox(eqn):
            return _megablox_flops(eqn)
        estimate = params.get("cost_estimate")
        if estimate is not None and getattr(estimate, "flops", None):
            return float(estimate.flops)
        grid = tuple(g for g in params["grid_mapping"].grid if isinstance(g, int))
        blocks: float = math.prod(grid)
        square = [n for i, n in enumerate(grid) if n in grid[i + 1:]]  # heads x query blocks x key blocks, any order
        if str(params.get("name", "")).startswith("splash_mha") and square:
            blocks = blocks * (square[0] + 1) / (2 * square[0])  # causal: n(n+1)/2 of n x n blocks run
        return blocks * jaxpr_flops(params["jaxpr"])
    if name == "shard_map":
        mesh = params["mesh"]
        manual = params.get("manual_axes", params.get("axis_names", mesh.axis_names))
        return math.prod(mesh.shape[a] for a in manual) * jaxpr_flops(params["jaxpr"])
    for key in _SUBJAXPR_PARAMS:
        sub = params.get(key)
        if isinstance(sub, (core.Jaxpr, core.ClosedJaxpr)):
            return jaxpr_flops(sub)
    return 0.0


def _is_megablox(eqn) -> bool:
    """A megablox grouped matmul (`gmm` or `tgmm`): a grid bounded by its active tiles and four index operands
    (group offsets [E + 1], group ids, row-tile ids, the first group computed)."""
    grid = eqn.params["grid_mapping"]
    return grid.num_dynamic_grid_bounds == 1 and grid.num_index_operands == 4


def _megablox_flops(eqn) -> float:
    """A megablox kernel's FLOPs: each row of its E_local groups' once, the rows shared evenly by the E groups of
    group_sizes (gmm: [m, k] x [E_local, k, n] -> [m, n]; tgmm: [m, k] and [m, n] -> [E_local, k, n])."""
    groups = eqn.invars[1].aval.shape[0] - 1
    first, second = (v.aval.shape for v in eqn.invars[5:7])
    out = eqn.outvars[0].aval.shape
    if len(out) == 2:  # gmm: every row through its group's [k, n], the local groups' share of the rows
        return 2.0 * math.prod(out) * first[1] * second[0] / groups
    return 2.0 * math.prod(out) * first[0] / groups  # tgmm: each local group's [k, n] over its share of m


def step_flops(run) -> float:
    """FLOPs of one call of a run's step (`spine.run.AbstractRun`), over all its devices, its dead code removed."""
    from jax._src.interpreters import partial_eval as pe  # JAX's own dead-code pass (scan, cond, jit rules)

    jaxpr = jax.make_jaxpr(run.step)(run.state, run.frozen, run.second, run.batch).jaxpr
    live, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return jaxpr_flops(live)
