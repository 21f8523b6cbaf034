"""`longest_context` and `jaxtune plan --longest-context`: the longest sequence some plan fits, on real shapes."""

import json

import pytest
from shapes import LLAMA3_8B

from jaxtune.config import ForwardOptions, MethodConfig, tiny_config
from jaxtune.config.plan import TrainPlan
from jaxtune.errors import JaxtuneError
from jaxtune.methods import method_config
from jaxtune.planner import estimate, get_device, longest_context, search

GiB = 1 << 30
# Llama-3-8B's shape with a context longer than any GPU fits (gradientai/Llama-3-8B-Instruct-Gradient-1048k), so
# memory, not the model, is the limit.
LLAMA3_8B_1M = LLAMA3_8B.replace(max_position_embeddings=1 << 20)
LORA = method_config("lora", rank=8, target_modules=("q_proj", "v_proj"))
QLORA = method_config("qlora", rank=8, bits=4, target_modules=("q_proj", "v_proj"))


def _plan(method: MethodConfig) -> TrainPlan:
    return TrainPlan(method, 1, 512, 1, param_dtype="bfloat16",
                     forward=ForwardOptions(compute_dtype="bfloat16", remat="none"))


def cli(capsys, *args) -> tuple[int, str, str]:
    """`jaxtune plan ARGS` in this process: (exit status, stdout, stderr)."""
    from jaxtune.cli import main

    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("method", [LORA, QLORA], ids=["lora", "qlora"])
def test_the_answer_fits_and_one_step_more_does_not(method):
    device = get_device("h100-80gb")
    found = longest_context(LLAMA3_8B_1M, _plan(method), device)
    assert found.seq_len % 256 == 0 and found.seq_len > 64 * 1024
    assert found.fastest.plan.seq_len == found.seq_len and found.fastest.estimate.fits
    assert found.too_long == found.seq_len + 256
    assert search(LLAMA3_8B_1M, _plan(method).replace(seq_len=found.seq_len), device).candidates
    assert not search(LLAMA3_8B_1M, _plan(method).replace(seq_len=found.too_long), device).candidates
    assert not estimate(LLAMA3_8B_1M, found.fastest.plan.replace(seq_len=found.too_long), device).fits
    assert found.leanest_too_long.peak_bytes > device.usable_bytes
    assert found.lengths_searched <= 2 * 12  # doubling then bisection, not a scan


def test_the_answer_grows_with_device_memory_and_with_qlora():
    lengths = {(method.kind, target): longest_context(LLAMA3_8B_1M, _plan(method), get_device(target)).seq_len
               for method in (LORA, QLORA) for target in ("rtx-4090", "h100-80gb")}
    for kind in ("lora", "qlora"):
        assert lengths[kind, "rtx-4090"] < lengths[kind, "h100-80gb"]
    for target in ("rtx-4090", "h100-80gb"):
        assert lengths["lora", target] < lengths["qlora", target]


@pytest.mark.parametrize("context, answer", [(512, 512), (1000, 768)])
def test_the_models_own_context_is_the_cap(context, answer):
    found = longest_context(tiny_config(max_position_embeddings=context), _plan(LORA), get_device("h100-80gb"))
    assert (found.seq_len, found.too_long, found.leanest_too_long, found.context) == (answer, None, None, context)


def test_a_step_of_choice_and_fixed_choices_are_kept():
    found = longest_context(LLAMA3_8B_1M, _plan(LORA), get_device("rtx-4090"), step=1000, fixed=("remat",))
    assert found.seq_len % 1000 == 0 and found.too_long == found.seq_len + 1000
    assert found.fastest.plan.forward.remat.policy == "none"


def test_nothing_fits_even_the_shortest_length():
    with pytest.raises(JaxtuneError, match=r"fits rtx-4090 even at the shortest length tried, 256 tokens \(the "
                                           r"leanest needs .* GiB, 21.6 GiB usable\)"):
        longest_context(LLAMA3_8B_1M, _plan(method_config("full")), get_device("rtx-4090"))


def test_cli_prints_the_line_and_json_has_the_numbers(capsys):
    args = ("--params", "7000", "--target", "rtx-4090", "--remat", "none", "--search", "--longest-context")
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    line = out.splitlines()[0]
    assert line.startswith("longest context that fits rtx-4090: ") and " tokens (LoRA r=16 on all-linear, batch 1 " \
        "x 1, remat none" in line and " does not fit (" in line and "GiB needed, 21.60 GiB usable)" in line
    code, out, err = cli(capsys, *args, "--json")
    assert code == 0, err
    result = json.loads(out)
    found = result["longest_context"]
    assert set(found) == {"seq_len", "limit", "too_long", "too_long_peak_bytes", "usable_bytes", "context",
                          "lengths_searched"}
    assert found["limit"] == "memory" and found["too_long"] == found["seq_len"] + 256 and found["context"] == 4096
    assert found["too_long_peak_bytes"] > found["usable_bytes"] == int(24 * GiB * 0.9)
    assert result["plan"]["seq_len"] == found["seq_len"] and result["fits"] is True
    assert f"{found['seq_len']:,} tokens" in line and f"{found['too_long']:,} does not fit" in line


def test_cli_on_a_model_directory_stops_at_its_context(capsys, tmp_path):
    from jaxtune.presets import write_random_model

    write_random_model(tmp_path / "m", "llama", max_position_embeddings=128)
    code, out, err = cli(capsys, "--model", str(tmp_path / "m"), "--target", "h100-80gb", "--longest-context",
                         "--seq-step", "32")
    assert code == 0, err
    assert out.startswith("longest context that fits h100-80gb: 128 tokens (LoRA r=16 on all-linear, batch 1 x 1, ")
    assert "the model's own context, 128 tokens (max_position_embeddings), is the limit" in out.splitlines()[0]


def test_cli_nothing_fits_is_one_line_and_exit_2(capsys):
    code, out, err = cli(capsys, "--params", "70000", "--method", "full", "--target", "rtx-4090", "--longest-context")
    assert code == 2 and not out and err.count("\n") == 1
    assert err.startswith("jaxtune: error: no plan with method full fits rtx-4090 even at the shortest length tried, "
                          "256 tokens (the leanest needs ")
