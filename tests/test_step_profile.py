"""benchmarks/step_profile.py's categories (issue 54): each rule on a small written HLO program, trace and torch ops,
the wall-clock sharing of overlapping thunks, the side-by-side tables, and one real traced step of a tiny model."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@functools.cache
def _profile():
    sys.path.insert(0, str(BENCHMARKS))  # step_profile imports its neighbours (_measure, _jax_worker)
    spec = importlib.util.spec_from_file_location("step_profile", BENCHMARKS / "step_profile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["step_profile"] = module  # its dataclasses' annotations are resolved through it
    spec.loader.exec_module(module)
    return module


LAYER = "jit(step)/while/body/closed_call/jvp()/while/body/closed_call"
BACK = "jit(step)/while/body/closed_call/transpose(jvp())/while/body/closed_call"


def _fused(name: str, ops: list[tuple[str, str, str]], op_name: str) -> tuple[str, str]:
    """A fusion instruction `name` calling a computation of `ops` (shape, opcode, op_name), and that computation."""
    body = "\n".join(f"  %{name}.{i} = {shape} {opcode}(%p), metadata={{op_name=\"{on}\"}}"
                     for i, (shape, opcode, on) in enumerate(ops))
    computation = f"%{name}_computation (p: f32[4]) -> f32[4] {{\n  %p = f32[4]{{0}} parameter(0)\n{body}\n}}\n"
    instruction = f"  %{name} = f32[4]{{0}} fusion(%x), kind=kLoop, calls=%{name}_computation"
    return instruction + f", metadata={{op_name=\"{op_name}\"}}", computation


CASES = {  # instruction -> (its ops (shape, opcode, op_name), its own op_name, the category)
    "dot_q": ([("f32[4]", "dot", f"{LAYER}/attention/ti,io->to/dot_general")], "", "attention GEMMs fwd"),
    "dot_dx": ([("f32[4]", "dot", f"{BACK}/mlp/to,io->ti/dot_general")], "", "MLP GEMMs bwd-input"),
    "dot_dw": ([("f32[4]", "dot", f"{BACK}/attention/...i,...o->io/dot_general"),
                ("f32[4]", "add", f"{BACK}/attention/add_any")], "", "attention GEMMs bwd-weight"),
    "dot_lora_dkernel": ([("f32[4]", "dot", f"{BACK}/attention/ni,no->io/dot_general")], "",
                         "attention GEMMs bwd-weight"),
    "dot_scores": ([("f32[4]", "dot", f"{BACK}/attention/kernel/bkgqh,bkch->bkgqc/dot_general"),
                    ("f32[4]", "multiply", f"{BACK}/attention/kernel/mul")], "", "attention kernel bwd"),
    "dot_lora": ([("f32[4]", "dot", f"{LAYER}/attention/lora/ni,ir->nr/dot_general")], "", "LoRA branches"),
    "dot_head": ([("f32[4]", "dot", "jit(step)/while/body/closed_call/transpose(jvp(head))/while/body/"
                                    "closed_call/ti,io->to/dot_general")], "", "head + loss"),
    "norm_and_sum": ([("f32[4]", "add", f"{BACK}/attention/add_any")] * 2
                     + [("f32[4]", "multiply", f"{BACK}/attention/norm/mul")], "", "norms"),
    "rope": ([("f32[4]", "multiply", f"{LAYER}/attention/rope/mul")], "", "RoPE"),
    "act": ([("f32[4]", "logistic", f"{LAYER}/mlp/activation/logistic")], "", "MLP activation"),
    "adamw": ([("f32[4]", "sqrt", "jit(step)/optimizer/cond/branch_1_fun/sqrt")], "", "optimizer"),
    "scores": ([("f32[4]", "exponential", f"{LAYER}/attention/kernel/exp")], "", "attention kernel fwd"),
    "residual": ([("f32[4]", "add", f"{LAYER}/attention/add")], "", "other"),
    # data movement only: the scan's writes (a scalar index's arithmetic aside), its zero-filled stacks, copies
    "write": ([("s32[]", "subtract", f"{BACK}/sub"), ("f32[4]", "dynamic-update-slice",
               "jit(step)/while/body/closed_call/jvp()/while/body/jit(dynamic_update_index_in_dim)/dynamic_update_slice")],
              "jit(step)/jvp()/while/body/jit(dynamic_update_index_in_dim)/dynamic_update_slice", "scan stacking"),
    "read": ([("f32[4]", "dynamic-slice", f"{BACK}/jit(dynamic_index_in_dim)/dynamic_slice")],
             f"{BACK}/jit(dynamic_index_in_dim)/dynamic_slice", "scan stacking"),
    "zeros": ([("f32[4]", "broadcast", "jit(step)/while/body/closed_call")], "jit(step)/while/body/closed_call",
              "scan stacking"),
    "kernel_zeros": ([("f32[4]", "broadcast", f"{LAYER}/attention/kernel/broadcast_in_dim")],
                     f"{LAYER}/attention/kernel/broadcast_in_dim", "attention kernel fwd"),
    "copy": ([("f32[4]", "transpose", f"{LAYER}/attention/transpose")], f"{LAYER}/attention/transpose",
             "copies/transposes"),
}


def test_each_rule_of_the_jaxtune_categories():
    sp = _profile()
    entry, computations = [], []
    for name, (ops, op_name, _) in CASES.items():
        instruction, computation = _fused(name, ops, op_name)
        entry.append(instruction)
        computations.append(computation)
    entry.append('  ROOT %while.1 = (s32[], f32[4]{0}) while(%t), condition=%c, body=%b, '
                 'metadata={op_name="jit(step)/while"}')
    text = "HloModule jit_step\n\n" + "\n".join(computations) + "\nENTRY %main (x: f32[4]) -> f32[4] {\n" + \
        "\n".join(entry) + "\n}\n"
    instructions = sp.parse_hlo(text)
    assert instructions["while.1"].op_name == "jit(step)/while"  # a tuple shape, spaces and all
    assert instructions["write"].ops == {"dynamic-update-slice"}  # the scalar index arithmetic is left out
    assert {name: sp.categorize(instructions[name]) for name in CASES} == \
        {name: category for name, (_, _, category) in CASES.items()}
    assert sp.scopes_of("jit(step)/transpose(jvp(head))/mlp/dot_general") == ["step", "head", "mlp", "dot_general"]


def test_overlapping_thunks_share_the_wall_clock():
    sp = _profile()
    thunk = lambda name, tid, ts, dur: {"ph": "X", "name": name, "tid": tid, "ts": ts, "dur": dur,  # noqa: E731
                                        "args": {"hlo_op": name}}
    events = [thunk("while.1", 1, 0.0, 100.0), thunk("a", 1, 10.0, 40.0), thunk("b", 2, 30.0, 40.0),
              {"ph": "X", "name": "end: a", "tid": 1, "ts": 50.0, "dur": 1.0, "args": {}},
              {"ph": "X", "name": "ThunkExecutor::Execute", "tid": 2, "ts": 0.0, "dur": 90.0}]
    seconds = sp.thunk_seconds(events)
    # a alone 10-30, with b 30-50 (half each), b alone 50-70; the while's time is its body's
    assert seconds == pytest.approx({"a": 30e-6, "b": 30e-6})


def test_each_rule_of_the_torch_categories():
    sp = _profile()
    op = lambda name, scopes, backward=False, shapes=(): sp.TorchOp(  # noqa: E731
        name=name, self_s=1.0, scopes=tuple(scopes), backward=backward, shapes=shapes)
    tokens = 1024
    cases = [
        (op("aten::addmm", ["attention"], shapes=((512,), (1024, 512), (512, 512))), "attention GEMMs fwd"),
        (op("aten::mm", ["attention"], True, ((1024, 512), (512, 512))), "attention GEMMs bwd-input"),
        (op("aten::mm", ["mlp"], True, ((1376, 1024), (1024, 512))), "MLP GEMMs bwd-weight"),
        (op("aten::mm", ["attention", "lora"], True, ((8, 1024), (1024, 512))), "LoRA branches"),
        (op("aten::bmm", ["attention", "kernel"], True), "attention kernel bwd"),
        (op("aten::mul", ["mlp"]), "MLP activation"),  # transformers' silu(gate) * up, outside act_fn
        (op("aten::silu", ["mlp", "activation"]), "MLP activation"),
        (op("aten::rsqrt", ["attention", "norm"], True), "norms"),
        (op("step_profile:rope", ["attention"]), "RoPE"),  # a range's own time: its Python
        (op("aten::_fused_adamw_", ["optimizer"]), "optimizer"),
        (op("aten::nll_loss_forward", ["head"]), "head + loss"),
        (op("aten::copy_", ["attention"]), "copies/transposes"),
        (op("aten::add", ["attention"]), "other"),
    ]
    assert [sp.torch_category(o, tokens) for o, _ in cases] == [category for _, category in cases]


def test_saved_profiles_print_side_by_side():
    sp = _profile()

    def report(jax_ms: float) -> dict:
        categories = dict.fromkeys(sp.CATEGORIES, 0.0) | {"optimizer": jax_ms}
        return {"results": [{"framework": "jax", "config": "lora_qv", "wall_ms": 2 * jax_ms,
                             "categorized_ms": jax_ms, "categories": categories}]}

    table = sp.tables([("before", report(10.0)), ("after", report(5.0))])
    assert "| category | jaxtune before | jaxtune after |" in table
    assert "| optimizer | 10.0 (50%) | 5.0 (50%) |" in table
    assert f"| {sp.IDLE} | 10.0 (50%) | 5.0 (50%) |" in table
    assert "| wall step | 20.0 | 10.0 |" in table


def _filled(fn):
    """fn's result as numpy arrays of 0.02 (from its shapes: no XLA program compiled): the categories read the
    program, not the weights' values, and drawing a model's random weights op by op is most of a cold test's time."""
    import jax
    import numpy as np

    return lambda *args: jax.tree.map(lambda s: np.full(s.shape, 0.02, s.dtype), jax.eval_shape(lambda: fn(*args)))


def test_a_traced_tiny_step_is_categorised(monkeypatch):
    sp = _profile()
    import _jax_worker

    from jaxtune.methods import transform
    from jaxtune.models import params

    monkeypatch.setattr(params, "init_params", _filled(params.init_params))
    monkeypatch.setattr(transform, "apply_method", _filled(transform.apply_method))
    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=8)
    profile = sp.jax_profile("lora_qv", 2, warmup=1, setup=_jax_worker.model_and_batch("lora_qv", shape, 2, 24))
    ms = profile["categories"]
    assert 0 < profile["categorized_ms"] <= profile["wall_ms"]
    assert ms["other"] <= 0.1 * profile["categorized_ms"], ms
    for category in ("attention GEMMs fwd", "MLP GEMMs fwd", "MLP GEMMs bwd-input", "attention kernel fwd",
                     "attention kernel bwd", "LoRA branches", "optimizer", "norms", "scan stacking"):
        assert ms[category] > 0, category
