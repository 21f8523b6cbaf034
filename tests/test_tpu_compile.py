"""The TPU compiler in the loop (issue 29): jaxtune's own step compiled by libtpu for a TPU slice's topology on this
CPU host, with the kernels a TPU runs; `plan --confirm` and `launch tpu` on its verdict. Nothing here runs on a TPU:
the figures are the compiler's (memory analysis, cost analysis, the program's text)."""

import json
import subprocess
import sys

import pytest

from jaxtune.cli import main
from jaxtune.config import ForwardOptions, MeshConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.methods import method_config
from jaxtune.planner.confirm import attention_kernel, collectives, compile_step
from jaxtune.planner.devices import get_device
from jaxtune.planner.slices import topology_devices, tpu_slice
from jaxtune.presets import tiny_model_config, write_random_model

pytestmark = pytest.mark.slow  # all but the HLO readers are the full tier's, whose install brings libtpu
LORA = method_config("lora", rank=4, target_modules=("all-linear",))


def tpu_devices(accelerator: str) -> list:
    return topology_devices(tpu_slice(get_device(accelerator)))


@pytest.mark.full
def test_slices_are_the_topologies_cloud_tpu_makes():
    """Chips, shape and hosts of each generation's slices as Cloud TPU names them (v4/v5p count TensorCores), and
    libtpu's devices for them: one a chip, on as many hosts."""
    expected = {"v5e-4": ("v5e:2x2", 4, 1), "v5e-8": ("v5e:2x4", 8, 1), "v5e-256": ("v5e:16x16", 256, 64),
                "v6e-64": ("v6e:8x8", 64, 16), "v5p-8": ("v5p:2x2x1", 4, 1), "v5p-128": ("v5p:4x4x4", 64, 16),
                "v4-32": ("v4:2x2x4", 16, 4)}
    for accelerator, (topology, chips, hosts) in expected.items():
        slice_ = tpu_slice(get_device(accelerator))
        assert (slice_.topology, slice_.chips, slice_.hosts) == (topology, chips, hosts)
        devices = topology_devices(slice_)
        assert len(devices) == chips and len({d.process_index for d in devices}) == hosts
        assert {d.platform for d in devices} == {"tpu"}
    with pytest.raises(Exception, match=r"v5e-12: Cloud TPU makes no v5e slice of 12 chips; slices: v5e-1, v5e-4"):
        tpu_slice(get_device("v5e-12"))


@pytest.mark.parametrize("arch,accelerator,mesh", [
    ("llama", "v5e-4", MeshConfig(fsdp=4)),
    ("llama", "v5e-4", MeshConfig(fsdp=2, tensor=2)),
    ("llama", "v5p-8", MeshConfig(data=2, fsdp=2)),
    ("mixtral", "v5p-8", MeshConfig(fsdp=2, expert=2)),
    ("mixtral", "v5e-4", MeshConfig(expert=2, tensor=2)),
])
@pytest.mark.full
def test_the_step_compiles_for_a_tpu_slice_with_the_tpu_kernels(arch, accelerator, mesh):
    """The trainer's LoRA step (bfloat16, 4 x 256 tokens) compiled by the TPU compiler for the slice, whatever the
    host: splash attention is in the program because the mesh's devices are TPUs (the host's backend is CPU), each
    device holds its share, and the mesh's collectives are there (all-to-all for experts routed across devices)."""
    cfg = tiny_model_config(arch, max_position_embeddings=512)
    plan = TrainPlan(LORA, forward=ForwardOptions(compute_dtype="bfloat16"), batch_size=4, seq_len=256,
                     param_dtype="bfloat16", mesh=mesh)
    compiled = compile_step(cfg, plan, tpu_devices(accelerator))
    assert compiled.backend == "tpu" and compiled.attention == "splash"
    assert 0 < compiled.total_bytes < 64 * 2**20 and compiled.flops > compiled.xla_flops > 0
    assert compiled.collectives["all-gather" if mesh.fsdp > 1 else "all-reduce"]["count"] > 0
    # experts: megablox's grouped matmul, on a tensor axis too (the TPU compiler makes ragged_dot dense)
    assert compiled.grouped_matmul == ("" if arch == "llama" else "megablox")
    blockwise = compile_step(cfg, plan.replace(attention="blockwise"), tpu_devices(accelerator))
    assert blockwise.attention == "blockwise"


def test_hlo_readers_on_known_text():
    """The program facts read from an optimised module's text: each collective once with the bytes it produces
    (an async start's output), and the attention kernel by its custom call."""
    text = """
  %all-gather-start.1 = (bf16[4,64]{1,0}, bf16[16,64]{1,0}) all-gather-start(%p), replica_groups=[1,4]<=[4]
  %all-gather.2 = f32[8,8]{1,0:T(8,128)} all-gather(%q), dimensions={0}
  %all-reduce.3 = f32[] all-reduce(%r), to_apply=%add
  %splash_mha_fwd.1 = (f32[256,128]{1,0}) custom-call(%a, %b), custom_call_target="tpu_custom_call"
"""
    assert collectives(text) == {"all-gather": {"count": 2, "bytes": 16 * 64 * 2 + 8 * 8 * 4},
                                 "all-reduce": {"count": 1, "bytes": 4}}
    assert attention_kernel(text) == "splash" and attention_kernel("%dot.1 = f32[2] dot(%a, %b)") == "blockwise"


@pytest.mark.full
def test_plan_confirm_on_a_tpu_target_reports_the_compilers_figures(tmp_path):
    """`jaxtune plan --confirm --target v5e-4 --json` on this CPU host: the TPU compiler's bytes a chip, FLOPs and
    bytes accessed, collectives, the kernel and remat compiled, its verdict against the chip's memory and a step
    time modelled from its figures."""
    model = write_random_model(tmp_path / "model", "llama", max_position_embeddings=1024)
    out = subprocess.run([sys.executable, "-m", "jaxtune.cli", "plan", "--model", str(model), "--method", "lora",
                          "--target", "v5e-4", "--seq", "512", "--remat", "full", "--confirm", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    compiled = json.loads(out.stdout)["compiled"]
    assert compiled["backend"] == "tpu" and compiled["topology"] == "v5e:2x2, 4 chips on 1 host"
    assert compiled["attention"] == "splash" and compiled["remat"] == "full" and compiled["fits"] is True
    assert compiled["total_bytes"] > 0 and compiled["flops"] > 0 and compiled["collectives"]
    assert compiled["modelled_step_seconds"] > 0 and 0 < compiled["usable_bytes"] <= 16 * 2**30
    assert out.stderr == ""  # libtpu's start-up notices stay off the terminal


@pytest.mark.full
def test_plan_confirm_on_a_gpu_target_says_it_cannot_compile_here(capsys):
    assert main(["plan", "--params", "100", "--method", "lora", "--target", "h100-80gb", "--confirm"]) == 0
    assert ("not compiled: no GPU compiler runs without a GPU: this host's backend is cpu, so the planner's figure "
            "stands") in capsys.readouterr().out


@pytest.mark.full
def test_launch_refuses_a_run_the_compiler_does_not_fit_before_any_gcloud_command(tmp_path):
    """`launch tpu --dry-run` compiles the run's step for the slice first: 128 rows of 8,192 tokens through a small
    model without remat need more than a v5e chip's 16 GiB (the compiler itself refuses the program), so it stops
    with the compiler's figures and no gcloud command is printed; the same run at 4 rows of 512 is compiled, fits,
    and the commands follow the verdict."""
    model = write_random_model(tmp_path / "model", "llama", hidden_size=512, intermediate_size=1376, num_layers=4,
                               num_heads=8, num_kv_heads=4, head_dim=64, max_position_embeddings=8192)
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\npath = "{model}"\ncompute_dtype = "bfloat16"\n[data]\ntrain = "{tmp_path}/train.jsonl"'
                      f'\nmax_seq_len = 8192\n[train]\noutput_dir = "gs://bucket/run"\nbatch_size = 128\n')
    launch = [sys.executable, "-m", "jaxtune.cli", "launch", "tpu", "--name", "t", "--zone", "z", "--accelerator",
              "v5e-4", "--dry-run", "--", "train", str(config)]
    refused = subprocess.run(launch, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr
    assert "+ gcloud" not in refused.stdout
    line = refused.stderr.strip()
    assert line.startswith("jaxtune: error: the TPU compiler refuses the step for v5e:2x2, 4 chips on 1 host: its "
                           "temporaries need ") and "\n" not in line
    assert "it does not fit; `jaxtune plan --config" in line and "--no-compile-check to launch anyway" in line
    fits = subprocess.run(launch + ["--set", "train.batch_size=4", "--set", "data.max_seq_len=512"],
                          capture_output=True, text=True, timeout=300)
    assert fits.returncode == 0, fits.stderr
    verdict, first_command = fits.stdout.splitlines()[:2]
    assert verdict.startswith("# the step compiled for v5e:2x2") and verdict.endswith(": fits")
    assert first_command.startswith("+ gcloud compute tpus tpu-vm describe t")


@pytest.mark.full
def test_program_flops_count_loops_by_their_trip_counts():
    """XLA's cost analysis counts a loop body once; the program's count multiplies a scan's body by its length and
    counts the backward's matmuls: 5 scanned [8, 16] @ [16, 16] matmuls are 5 x 2 x 8 x 16 x 16 FLOPs forward, three
    times that with the gradient of the weights."""
    import jax
    import jax.numpy as jnp

    from jaxtune.planner.program_flops import jaxpr_flops

    def f(x, ws):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0].sum()

    x, ws = jnp.ones((8, 16)), jnp.ones((5, 16, 16))
    assert jaxpr_flops(jax.make_jaxpr(f)(x, ws)) == 5 * 2 * 8 * 16 * 16
    assert jaxpr_flops(jax.make_jaxpr(jax.grad(f, argnums=1))(x, ws)) == 3 * 5 * 2 * 8 * 16 * 16
    xla = jax.jit(jax.grad(f, argnums=1)).lower(x, ws).compile().cost_analysis()
    assert xla["flops"] < 2 * 2 * 8 * 16 * 16 * 3  # one trip of the loop, not five


@pytest.mark.full
def test_program_flops_count_megablox_by_the_rows_of_the_local_experts():
    """A megablox grouped matmul of 256 rows over E = 4 groups with the kernels of 2 of them (a device of a 2-way
    expert axis) counts half of 2 x 256 x 64 x 96 FLOPs, and its backward (gmm for the rows, tgmm for the kernels)
    twice that again; ragged_dot over all 4 groups counts every row."""
    import jax
    import jax.numpy as jnp

    from jaxtune.models.moe import megablox_matmul
    from jaxtune.planner.program_flops import jaxpr_flops

    x, kernels, sizes = jnp.ones((256, 64)), jnp.ones((2, 64, 96)), jnp.array([100, 50, 60, 46], jnp.int32)
    local = lambda x, w: megablox_matmul(x, {"kernel": w}, sizes, jnp.asarray(2), None, True).sum()  # noqa: E731
    assert jaxpr_flops(jax.make_jaxpr(local)(x, kernels)) == 2 * 256 * 64 * 96 / 2
    assert jaxpr_flops(jax.make_jaxpr(jax.grad(local, argnums=(0, 1)))(x, kernels)) == 3 * 2 * 256 * 64 * 96 / 2
    every = lambda x, w: jax.lax.ragged_dot(x, w, sizes).sum()  # noqa: E731
    assert jaxpr_flops(jax.make_jaxpr(every)(x, jnp.ones((4, 64, 96)))) == 2 * 256 * 64 * 96


@pytest.mark.full
def test_plan_search_confirm_compiles_the_best_candidate_and_bisects_its_batch(tmp_path):
    """`plan --search --confirm` on a TPU slice: the best candidate compiled by the TPU compiler, then the largest
    batch it accepts for that plan, bisected in multiples of the rows a batch splits into (a tiny model fits every
    batch up to the search's bound of 8 times the planner's)."""
    model = write_random_model(tmp_path / "model", "llama", max_position_embeddings=1024)
    out = subprocess.run([sys.executable, "-m", "jaxtune.cli", "plan", "--model", str(model), "--method", "lora",
                          "--target", "v5e-4", "--seq", "512", "--batch", "4", "--search", "--confirm", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["compiled_candidates"][0]["fits"] and result["compiled"]["topology"].startswith("v5e:2x2")
    bound = result["compiled_bound"]
    assert bound["field"] == "batch_size" and bound["planner"] == 4 and bound["accepted"] == 32
    assert [t["value"] for t in bound["tries"]] == [4, 8, 16, 32] and all(t["fits"] for t in bound["tries"])
