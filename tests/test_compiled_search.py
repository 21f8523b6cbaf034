"""The compiler-checked search's bisection, the target's compute dtype and the one-line refusals of `--confirm` on a
TPU target (issue 29), without compiling: the compiler's verdict is replaced by a known bound."""

import types

import pytest

from jaxtune.config import MeshConfig, tiny_config
from jaxtune.config.plan import TrainPlan
from jaxtune.errors import JaxtuneError
from jaxtune.methods import method_config
from jaxtune.planner import compiled_search
from jaxtune.planner.devices import get_device

PLAN = TrainPlan(method_config("lora", rank=4, target_modules=("all-linear",)), 8, 4096, mesh=MeshConfig(fsdp=4))


def bounded(monkeypatch, field: str, largest: int) -> list[int]:
    """`confirm_plan` replaced by a compiler that accepts `field` up to `largest`; returns the values compiled."""
    compiled = []

    def confirm_plan(cfg, plan, device):
        value = getattr(plan, field)
        compiled.append(value)
        return types.SimpleNamespace(fits=value <= largest, peak_bytes=value,
                                     compiled=types.SimpleNamespace(compile_seconds=1.0))

    monkeypatch.setattr("jaxtune.planner.compiled_search.confirm_plan", confirm_plan)
    return compiled


@pytest.mark.parametrize("planner,largest", [(9984, 10240), (9984, 9984), (11264, 10240), (4096, 65536),
                                             (4096, 256), (4096, 100)])
def test_bisection_finds_the_longest_context_the_compiler_accepts(monkeypatch, planner, largest):
    """From the planner's answer, up or down by 1, 2, 4 ... steps and then halving: the compiler's largest multiple
    of 256 (none below one step), in six compiles or fewer when the planner is within five steps."""
    compiled = bounded(monkeypatch, "seq_len", largest)
    bound = compiled_search.largest_accepted(tiny_config(), PLAN, get_device("v5e-4"), "seq_len", planner, 256,
                                             131072)
    assert bound.accepted == (largest // 256 * 256 if largest >= 256 else None)
    assert [t.value for t in bound.tries] == compiled and compiled[0] == planner // 256 * 256
    assert all(v % 256 == 0 for v in compiled) and len(set(compiled)) == len(compiled)
    if abs(planner - largest) <= 1280:
        assert len(compiled) <= 6


def test_bisection_stops_at_the_limit(monkeypatch):
    """The model's context bounds the search: a compiler that accepts everything gives the limit (rounded down to
    a step)."""
    bounded(monkeypatch, "seq_len", 10**9)
    bound = compiled_search.largest_accepted(tiny_config(), PLAN, get_device("v5e-4"), "seq_len", 2048, 256, 8000)
    assert bound.accepted == 7936 and bound.tries[-1].value == 7936


def test_batch_bisection_keeps_rows_splittable(monkeypatch):
    compiled = bounded(monkeypatch, "batch_size", 44)
    bound = compiled_search.largest_accepted(tiny_config(), PLAN, get_device("v5e-4"), "batch_size", 8, 4, 64)
    assert bound.accepted == 44 and all(v % 4 == 0 for v in compiled)
    assert "the largest batch (rows a step over all devices) the TPU compiler accepts for v5e:2x2: 44 (planner 8)" \
        in compiled_search.format_bound(bound, "v5e:2x2")


def test_compute_dtype_auto_follows_the_devices(tmp_path):
    """`[model] compute_dtype = "auto"` (the default): bfloat16 on TPUs and GPUs, float32 on a CPU; the plan of a
    run config for a TPU target says bfloat16."""
    from jaxtune.planner.command import make_plan, plan_from_run_config
    from jaxtune.presets import write_random_model
    from jaxtune.run_config import load_run_config

    model = write_random_model(tmp_path / "model", "llama")
    (tmp_path / "run.toml").write_text(f'[model]\npath = "{model}"\n[data]\ntrain = "t.jsonl"\n')
    config = load_run_config(tmp_path / "run.toml")
    assert config.model.forward.compute_dtype == "auto"
    assert plan_from_run_config(config, "tpu")[1].forward.compute_dtype == "bfloat16"
    assert plan_from_run_config(config, "gpu")[1].forward.compute_dtype == "bfloat16"
    assert plan_from_run_config(config, "cpu")[1].forward.compute_dtype == "float32"
    assert plan_from_run_config(config)[1].forward.compute_dtype == "float32"  # this host: a CPU
    assert make_plan(config=str(tmp_path / "run.toml"), target="v5e-8")[1].forward.compute_dtype == "bfloat16"
    (tmp_path / "run.toml").write_text(f'[model]\npath = "{model}"\ncompute_dtype = "float32"\n'
                                       '[data]\ntrain = "t.jsonl"\n')
    assert plan_from_run_config(load_run_config(tmp_path / "run.toml"), "tpu")[1].forward.compute_dtype == "float32"


def test_no_tpu_compiler_says_what_to_install(monkeypatch):
    """Without libtpu (JAX has no TPU plugin), a TPU slice's devices are one line saying what to install."""
    from jax.experimental import topologies

    from jaxtune.planner.slices import topology_devices, tpu_slice

    def no_plugin(**kwargs):
        raise RuntimeError("Unknown backend tpu")

    monkeypatch.setattr(topologies, "get_topology_desc", no_plugin)
    with pytest.raises(JaxtuneError, match=r'the TPU compiler is not installed here \(Unknown backend tpu\); pip '
                                           r'install "jaxtune\[tpu\]"'):
        topology_devices(tpu_slice(get_device("v5e-8")))


def test_an_unknown_slice_names_the_sizes_that_exist(capsys):
    from jaxtune.cli import main

    assert main(["plan", "--params", "100", "--target", "v5p-24", "--confirm"]) == 2
    assert "v5p-24: Cloud TPU makes no v5p slice of 12 chips; slices: v5p-8, v5p-16, v5p-32" in capsys.readouterr().err


def test_launch_without_a_tpu_compiler_says_what_to_install_before_any_gcloud_command(tmp_path, monkeypatch, capsys):
    """`launch tpu` on a host without libtpu: one line naming what to install and how to launch without the check;
    no gcloud command is printed."""
    from jax.experimental import topologies

    from jaxtune.cli import main
    from jaxtune.presets import write_random_model

    def no_plugin(**kwargs):
        raise RuntimeError("Unknown backend tpu")

    monkeypatch.setattr(topologies, "get_topology_desc", no_plugin)
    model = write_random_model(tmp_path / "model", "llama")
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\npath = "{model}"\n[data]\ntrain = "{tmp_path}/train.jsonl"\n[train]\n'
                      'output_dir = "gs://bucket/run"\nbatch_size = 4\n')
    assert main(["launch", "tpu", "--name", "t", "--zone", "z", "--accelerator", "v5e-4", "--dry-run", "--", "train",
                 str(config)]) == 2
    out = capsys.readouterr()
    assert "+ gcloud" not in out.out
    assert out.err.strip() == ('jaxtune: error: the compile check: the TPU compiler is not installed here (Unknown '
                               'backend tpu); pip install "jaxtune[tpu]" (libtpu, the TPU compiler; it runs on any '
                               'Linux x86-64 host) (--no-compile-check to launch without it)')
