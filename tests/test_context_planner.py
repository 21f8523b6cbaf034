"""The planner on a `context` mesh axis: `--mesh context=N`, the per-device estimate of a row split over N devices,
the collectives of ring and all-gather attention, the search and the longest context over context sizes, and (slow)
the estimate against XLA's compiled step on 8 fake CPU devices (tests/context_planner_worker.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shapes import LLAMA3_8B

from jaxtune.config import ForwardOptions, MeshConfig, ModelConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.errors import JaxtuneError
from jaxtune.methods import method_config
from jaxtune.planner import estimate, get_device, longest_context, search, step_time
from jaxtune.planner.command import parse_mesh
from jaxtune.planner.timing import context_bytes, ring_steps

WORKER = Path(__file__).parent / "context_planner_worker.py"
# Llama-3.1-8B's shape (its config.json), with room for contexts beyond its own 131,072 tokens
LLAMA_8B = LLAMA3_8B.replace(max_position_embeddings=1 << 21)
LORA = method_config("lora", rank=16, target_modules=("all-linear",))
ONE_DEVICE = MeshConfig(fsdp=1)


def test_parse_mesh_reads_a_context_axis():
    assert parse_mesh("fsdp=1,context=8").sizes() == {"data": 1, "fsdp": 1, "expert": 1, "context": 8, "tensor": 1}
    assert parse_mesh("context=4").resolve(8) == {"data": 1, "fsdp": 2, "expert": 1, "context": 4, "tensor": 1}
    assert parse_mesh("2x2x1x2").sizes() == {"data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    with pytest.raises(JaxtuneError, match="unknown axis 'ctx'"):
        parse_mesh("ctx=8")


def test_plan_command_takes_a_context_axis_and_its_strategy(capsys):
    """`jaxtune plan --mesh fsdp=1,context=8 --context-attention all_gather` plans that; a sequence the axis cannot
    split is one line."""
    from jaxtune.cli import main

    args = ["plan", "--params", "1000", "--method", "lora", "--target", "h100-80gb-8", "--batch", "1", "--remat",
            "full", "--mesh", "fsdp=1,context=8"]
    ring = json.loads((main([*args, "--seq", "65536", "--json"]), capsys.readouterr().out)[1])
    gather = json.loads((main([*args, "--seq", "65536", "--json", "--context-attention", "all_gather"]),
                         capsys.readouterr().out)[1])
    assert ring["plan"]["context_attention"] == "ring" and gather["plan"]["context_attention"] == "all_gather"
    assert ring["plan"]["mesh"]["context"] == 8
    assert gather["per_device"]["activations_bytes"] > ring["per_device"]["activations_bytes"]
    assert main([*args, "--seq", "65544"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "65544" in err and "context = 8" in err, err


def test_context_8_holds_a_fraction_of_one_devices_activations():
    """One 32,768-token row of Llama-3.1-8B, LoRA, remat full: on context=8 each device holds an eighth of the
    tokens' activations and an eighth of the weights (ZeRO-3 over context)."""
    plan = TrainPlan(LORA, 1, 32768, 1, forward=ForwardOptions(compute_dtype="bfloat16", remat="full"))
    one = estimate(LLAMA_8B, plan.replace(mesh=ONE_DEVICE), get_device("h100-80gb"))
    eight = estimate(LLAMA_8B, plan.replace(mesh=MeshConfig(fsdp=1, context=8)), get_device("h100-80gb-8"))
    assert eight.saved_activations_bytes == one.saved_activations_bytes // 8
    assert eight.activations_bytes < one.activations_bytes / 6
    assert eight.frozen_bytes < one.frozen_bytes / 7
    assert eight.total_bytes < one.total_bytes / 4, (eight.total_bytes, one.total_bytes)


def test_zero_3_splits_model_states_over_fsdp_and_context_alike():
    """Weights, gradients and optimizer state a device: the same on fsdp=8, context=8 and fsdp=2 x context=4."""
    plan = TrainPlan(method_config("full"), 8, 2048, 1, forward=ForwardOptions(compute_dtype="bfloat16", remat="full"))
    states = [estimate(LLAMA_8B, plan.replace(mesh=mesh), get_device("h100-80gb-8")) for mesh in
              (MeshConfig(fsdp=8), MeshConfig(fsdp=1, context=8), MeshConfig(fsdp=2, context=4))]
    assert len({(e.trainable_bytes, e.optimizer_bytes, e.model_states_bytes) for e in states}) == 1


def test_ring_and_all_gather_collectives():
    """Both send (N - 1) / N of a layer's keys and values a pass; a ring whose windows reach only the previous
    device's tokens stops there, and sends a fraction of it."""
    sizes = {"data": 1, "fsdp": 1, "expert": 1, "context": 8, "tensor": 1}
    plan = TrainPlan(LORA, 1, 65536, 1, forward=ForwardOptions(compute_dtype="bfloat16", remat="full"),
                     mesh=MeshConfig(fsdp=1, context=8))
    ring, gather = (context_bytes(LLAMA_8B, plan.replace(context_attention=s), sizes, 2) for s in
                    ("ring", "all_gather"))
    assert ring == pytest.approx(gather, rel=0.1)
    windowed = dataclasses.replace(LLAMA_8B, sliding_windows=(4096,) * LLAMA_8B.num_layers)
    assert ring_steps(LLAMA_8B, plan, sizes) == 8 and ring_steps(windowed, plan, sizes) == 2
    assert context_bytes(windowed, plan, sizes, 2) < ring / 5
    assert context_bytes(LLAMA_8B, plan.replace(mesh=ONE_DEVICE), {**sizes, "context": 1}, 2) == 0


def test_a_context_axis_shares_the_work():
    """The step's FLOPs over all devices are one device's: each of 8 does an eighth of the row."""
    plan = TrainPlan(LORA, 1, 32768, 1, forward=ForwardOptions(compute_dtype="bfloat16", remat="full"))
    one = step_time(estimate(LLAMA_8B, plan.replace(mesh=ONE_DEVICE), get_device("h100-80gb")))
    eight = step_time(estimate(LLAMA_8B, plan.replace(mesh=MeshConfig(fsdp=1, context=8)),
                               get_device("h100-80gb-8")))
    assert eight.flops == pytest.approx(one.flops, rel=1e-6)
    assert eight.step_s < one.step_s / 6


def test_search_splits_one_long_row_over_context():
    """A batch of one 131,072-token row on 8 H100s: fsdp cannot split it, a context axis can."""
    plan = TrainPlan(LORA, 1, 131072, 1, forward=ForwardOptions(compute_dtype="bfloat16", remat="full"))
    result = search(LLAMA_8B, plan, get_device("h100-80gb-8"))
    assert result.candidates and all(c.estimate.mesh["fsdp"] == 1 for c in result.candidates)
    assert result.candidates[0].estimate.mesh["context"] > 1
    assert not search(LLAMA_8B, plan.replace(mesh=MeshConfig(fsdp=8)), get_device("h100-80gb-8"), fixed=("mesh",)
                      ).candidates


def test_longest_context_on_eight_devices_is_far_beyond_one():
    plan = TrainPlan(LORA, 1, 2048, 1, forward=ForwardOptions(compute_dtype="bfloat16", remat="full"))
    one = longest_context(LLAMA_8B, plan, get_device("h100-80gb"), step=4096)
    eight = longest_context(LLAMA_8B, plan, get_device("h100-80gb-8"), step=4096)
    assert eight.seq_len > 6 * one.seq_len, (one.seq_len, eight.seq_len)
    assert eight.fastest.estimate.mesh["context"] == 8


def test_grpo_keeps_its_rows_whole():
    plan = TrainPlan(LORA, 1, 4096, 1, forward=ForwardOptions(compute_dtype="bfloat16", remat="full"),
                     mesh=MeshConfig(fsdp=1, context=2), objective="grpo", generate_tokens=256)
    with pytest.raises(JaxtuneError, match="rollout"):
        estimate(LLAMA_8B, plan, get_device("h100-80gb-2"))


@pytest.mark.slow
@pytest.mark.full
def test_estimate_on_context_meshes_agrees_with_the_compiled_step():
    """13 context-parallel steps of a small Llama (2k to 32k tokens, context 2 to 8, ring and all-gather, remat none
    and full, LoRA, QLoRA and full fine-tuning, beside fsdp, data and tensor) on 8 fake CPU devices: the per-device
    estimate within 15% of XLA's figure for each."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"}
    out = subprocess.run([sys.executable, str(WORKER)], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rows) == 13
    errors = {row: estimated / compiled - 1 for row, (estimated, compiled) in rows.items()}
    assert all(abs(e) < 0.15 for e in errors.values()), errors


def test_todays_planner_meets_the_tpu_compilers_context_rows():
    """Llama-3.1-8B's LoRA at 131,072 tokens on v5p-16 (context=8) and 1,048,576 on v5p-128 (context=64), as the TPU
    compiler compiled them (experiments/results/tpu_compile_table.json): today's estimate within 15% of the
    compiler's bytes a chip, and both within the chip's HBM."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "experiments"))
    import tpu_compile_table as table

    results = {r["label"]: r for r in json.loads(table.RESULTS.read_text())}
    rows = [row for row in table.ROWS if "context=" in row[6]]
    assert {row[3] for row in rows} == {131072, 1048576}
    for row in rows:
        compiled = results[table.label(row)]
        cfg, plan, device = table.model_and_plan(row)
        est = estimate(cfg, plan, device)
        assert abs(est.compiled_bytes / compiled["compiled_bytes"] - 1) < 0.15, (row, est.compiled_bytes)
        assert est.fits and compiled["compiler_fits"] and not compiled["over_memory"]


@pytest.mark.slow
@pytest.mark.full
def test_a_tiled_mlp_is_counted_as_the_compiler_holds_it():
    """`[model] tiled_mlp`: one 16,384-token row in tiles of 2,048 on one CPU device (LoRA remat full and none, a
    full fine-tune): the estimate within 15% of XLA's compiled step, and well below the untiled estimate; under
    save_matmuls the tiles' matmul outputs are all kept, and the estimate is the untiled one."""
    from jaxtune.planner import compile_step

    cfg = ModelConfig(vocab_size=8000, hidden_size=256, intermediate_size=1408, num_layers=4, num_heads=8,
                      num_kv_heads=4, head_dim=32, max_position_embeddings=16384)
    cpu = get_device("cpu")
    for method, remat in ((LORA, "full"), (LORA, "none"), (method_config("full"), "full")):
        plan = TrainPlan(method, 1, 16384, 1, param_dtype="float32",
                         forward=ForwardOptions(compute_dtype="float32", remat=remat, tiled_mlp=2048), mesh=ONE_DEVICE)
        tiled = estimate(cfg, plan, cpu).compiled_bytes
        assert abs(tiled / compile_step(cfg, plan).total_bytes - 1) < 0.15, (method.kind, remat)
        assert tiled < 0.6 * estimate(cfg, plan.replace(tiled_mlp=0), cpu).compiled_bytes, (method.kind, remat)
    plan = TrainPlan(LORA, 1, 16384, 1, param_dtype="float32",
                     forward=ForwardOptions(compute_dtype="float32", remat="save_matmuls"), mesh=ONE_DEVICE)
    assert estimate(cfg, plan.replace(tiled_mlp=2048), cpu).compiled_bytes == estimate(cfg, plan, cpu).compiled_bytes
