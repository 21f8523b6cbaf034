"""Adding a method, an objective or an attention kernel is one unit and one registry line: a toy of each, defined
here and nowhere else, runs through the library. The toy method trains through `fine_tune`, merges, exports to PEFT
and is planned; the toy objective (with a TOML section of its own) trains and is planned; the toy kernel runs the
forward and the planner counts it as it declares."""

import dataclasses
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import dense_attention

from jaxtune.config import ForwardOptions
from jaxtune.config.method import AdapterForward, DenseHook, MethodConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.errors import ConfigError
from jaxtune.methods import METHODS, method_config
from jaxtune.methods.base import Method, PeftFormat, PlannerCosts
from jaxtune.methods.targets import peft_module
from jaxtune.methods.transform import apply_method, parameter_report
from jaxtune.models.kernels import KERNELS, AttentionKernel, KernelCosts
from jaxtune.models.llama import forward
from jaxtune.models.params import init_params
from jaxtune.models.quant import full_shape
from jaxtune.objectives import OBJECTIVES
from jaxtune.objectives.sft import SFT
from jaxtune.planner.devices import get_device
from jaxtune.planner.estimate import estimate
from jaxtune.planner.timing import step_time
from jaxtune.presets import tiny_model_config, write_random_model
from jaxtune.run_config import load_run_config
from jaxtune.spine.model import load_model
from jaxtune.train.export import export_run
from jaxtune.train.loop import fine_tune

DEMO = Path(__file__).resolve().parents[1] / "jaxtune" / "assets" / "demo_instructions.jsonl"


# ---- the toy method: LoRA by another name (leaves toy_a [L, in, r], toy_b [L, r, out]; y += alpha / r x A B) ----

def toy_add(x, y, module, kernel, branch, scale):
    return y + scale * ((x @ module["toy_a"].astype(x.dtype)) @ module["toy_b"].astype(x.dtype))


@dataclass(frozen=True, kw_only=True)
class ToyConfig(MethodConfig):
    """The toy's own options: the [method] keys of kind "toy"."""

    kind: ClassVar[str] = "toy"

    rank: int = 4
    alpha: float = 8.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")

    def __post_init__(self):
        if self.rank <= 0:
            raise ConfigError("rank", self.rank, "must be > 0")

    def forward_of(self, cfg) -> AdapterForward:
        add = lambda x, y, module, kernel, branch: toy_add(x, y, module, kernel, branch, self.alpha / self.rank)
        return AdapterForward(dense=(DenseHook("toy_a", add=add),))


def add_toy(params, cfg, method, key):
    layers = dict(params["layers"])
    for i, name in enumerate(method.target_modules):
        L, d_in, d_out = full_shape(layers[name]["kernel"])
        a = jax.random.normal(jax.random.fold_in(key, i), (L, d_in, method.rank)) / np.sqrt(d_in)
        layers[name] = {**layers[name], "toy_a": a, "toy_b": jnp.zeros((L, method.rank, d_out))}
    return {**params, "layers": layers}


def toy_merged(module, scale):
    kernel = module["kernel"].astype(jnp.float32)
    return kernel + scale * jnp.einsum("...ir,...ro->...io", module["toy_a"], module["toy_b"])


def toy_merge(params, method, dtype=None):
    layers = {name: ({k: v for k, v in m.items() if not k.startswith("toy_")}
                     | {"kernel": toy_merged(m, method.alpha / method.rank).astype(dtype or m["kernel"].dtype)})
              if isinstance(m, dict) and "toy_a" in m else m for name, m in params["layers"].items()}
    return {**params, "layers": layers}


def toy_merged_layer(params, method):
    def tensor(path, layer):
        module = params["layers"].get(path[1]) if path[0] == "layers" and len(path) == 3 else None
        if not isinstance(module, dict) or "toy_a" not in module or path[2] != "kernel":
            return None
        one = jax.tree.map(lambda x: x[layer], module)
        return toy_merged(one, method.alpha / method.rank).astype(module["kernel"].dtype)

    return tensor


def toy_peft_config(cfg, method):
    return {"peft_type": "LORA", "r": method.rank, "lora_alpha": method.alpha, "lora_dropout": 0.0,
            "target_modules": list(method.target_modules), "bias": "none", "init_lora_weights": True}


def toy_peft_tensors(params, cfg, method):
    state = {}
    for name in method.target_modules:
        a, b = (np.asarray(params["layers"][name][k], np.float32) for k in ("toy_a", "toy_b"))
        for i in range(cfg.num_layers):
            state[f"{peft_module(name, i)}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            state[f"{peft_module(name, i)}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    return state


TOY = Method(
    kind="toy",
    options=ToyConfig,
    add_leaves=add_toy,
    leaves=("toy_a", "toy_b"),
    module_axes={"toy_a": lambda layers, d_in, d_out: (layers, d_in, "lora_rank"),
                 "toy_b": lambda layers, d_in, d_out: (layers, "lora_rank", d_out)},
    adapted=lambda method, stacks: {m: method.rank for m in method.target_modules if m in dict(stacks)},
    merge=toy_merge,
    merged_layer=toy_merged_layer,
    peft=PeftFormat((), (), toy_peft_config, toy_peft_tensors),
    costs=PlannerCosts(trains_input=lambda method, module, adapted: module in adapted, low_rank=True),
)


# ---- the toy objective: SFT's loss times its own section's factor ([sft_scaled] factor) ----

@dataclass(frozen=True)
class ScaledConfig:
    factor: float = 2.0


def scaled_loss_terms(ctx):
    terms = SFT.loss_terms(ctx)

    def scaled(trainable, frozen, second, micro, key=None):
        loss, (count, metrics) = terms(trainable, frozen, second, micro, key)
        return ctx.section.factor * loss, (count, metrics)

    return scaled


SFT_SCALED = replace(SFT, name="sft_scaled", loss_terms=scaled_loss_terms, section=ScaledConfig)


# ---- the toy attention kernel: the whole [T, S] score matrix at once, on CPU when asked for by name ----

def toy_attend(q_BxTxKxGxh, k_BxSxKxh, v_BxSxKxh, call):
    q, k, v = jnp.transpose(q_BxTxKxGxh, (0, 2, 3, 1, 4)), *(jnp.swapaxes(a, 1, 2) for a in (k_BxSxKxh, v_BxSxKxh))
    out = dense_attention(q, k, v, call.mask, call.window, call.scale, call.softcap)
    return jnp.transpose(out, (0, 3, 1, 2, 4))


def toy_workspace(b, heads, T, S, itemsize) -> int:
    return 3 * b * heads * T * S * 4  # scores, probabilities and their gradient, float32, whole


TOY_KERNEL = AttentionKernel("toy_dense", platforms=(), covers=lambda shape: None, attend=toy_attend,
                             off_platform="interpret", costs=KernelCosts(workspace=toy_workspace, passes=4.0))


@pytest.fixture
def toys():
    """The toy method, objective and kernel registered, and forgotten again after the test."""
    METHODS[TOY.kind] = TOY
    OBJECTIVES[SFT_SCALED.name] = SFT_SCALED
    KERNELS[TOY_KERNEL.name] = TOY_KERNEL
    yield
    METHODS.pop(TOY.kind)
    OBJECTIVES.pop(SFT_SCALED.name)
    KERNELS.pop(TOY_KERNEL.name)


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("units")
    data = root / "data.jsonl"
    data.write_text("".join(DEMO.read_text().splitlines(keepends=True)[:48]))
    return write_random_model(root / "model", "llama", seed=0, initializer_range=0.1), data


def run_config(tmp_path, model, data, method: str, objective: str = "sft", steps: int = 6, extra: tuple = ()):
    path = tmp_path / f"{method}-{objective}.toml"
    path.write_text("\n".join([
        "[model]", f'path = "{model}"', "[method]", f'kind = "{method}"', "rank = 4", "alpha = 8.0",
        "[data]", f'train = "{data}"', "max_seq_len = 96", "eval_fraction = 0.25",
        "[train]", f'output_dir = "{tmp_path / (method + "-" + objective)}"', f"max_steps = {steps}",
        "batch_size = 4", "learning_rate = 1e-2", "log_every = 1", f'objective = "{objective}"', *extra]) + "\n")
    return load_run_config(path)


def train_losses(run_dir) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def test_an_unregistered_kind_fails_loudly(toys):
    method = method_config("toy")
    METHODS.pop(TOY.kind)  # its options exist; the registry does not know it
    with pytest.raises(ConfigError, match='kind = "toy": choose one of full, lora, qlora, ia3, prefix, adapter'):
        apply_method(init_params(tiny_model_config(), jax.random.key(0)), tiny_model_config(), method,
                     jax.random.key(1))
    METHODS[TOY.kind] = TOY


def test_the_toy_s_options_are_its_own(toys, tmp_path):
    """[method] of kind "toy" takes the toy's keys and no other unit's (an unknown key names who reads it)."""
    assert method_config("toy", rank=2) == ToyConfig(rank=2)
    with pytest.raises(ConfigError, match="^dora = true: is for lora and qlora, not toy$"):
        method_config("toy", dora=True)
    (tmp_path / "c.toml").write_text('[method]\nkind = "toy"\nrank = 2\nbits = 4\n')
    with pytest.raises(Exception, match="unknown key 'bits' in section \\[method\\] for kind 'toy'.*it is an option of "
                                        "qlora"):
        load_run_config(tmp_path / "c.toml")


def test_the_toy_forward_equals_lora_with_the_same_matrices(toys):
    cfg = tiny_model_config()
    base = init_params(cfg, jax.random.key(0))
    toy_method, lora_method = method_config("toy", rank=4, alpha=8.0), method_config("lora", rank=4, alpha=8.0)
    toy = apply_method(base, cfg, toy_method, jax.random.key(1))
    toy = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.05 if jax.tree_util.keystr(path).endswith("['toy_b']") else x, toy)
    lora = apply_method(base, cfg, lora_method, jax.random.key(1))
    layers = {**lora["layers"], **{m: {**lora["layers"][m], "lora_a": toy["layers"][m]["toy_a"],
                                       "lora_b": toy["layers"][m]["toy_b"]} for m in ("q_proj", "v_proj")}}
    tokens = jnp.arange(24).reshape(2, 12) % cfg.vocab_size
    ours = forward(toy, tokens, cfg, method=toy_method)
    np.testing.assert_allclose(ours, forward({**lora, "layers": layers}, tokens, cfg, method=lora_method),
                               rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(ours - forward(base, tokens, cfg))).max() > 1e-3  # the branch matters
    np.testing.assert_allclose(forward(toy_merge(toy, toy_method), tokens, cfg), ours, rtol=1e-4, atol=1e-4)
    L, D = cfg.num_layers, cfg.hidden_size
    assert parameter_report(toy, toy_method).trainable == L * 4 * ((D + cfg.q_size) + (D + cfg.kv_size))


def test_a_method_from_a_test_trains_merges_exports_and_is_planned(toys, model_and_data, tmp_path):
    model, data = model_and_data
    config = run_config(tmp_path, model, data, "toy")
    fine_tune(config, log=lambda _: None)
    run = tmp_path / "toy-sft"
    losses = train_losses(run)
    assert losses[-1] < losses[0]
    adapter = run / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["peft_type"] == "LORA"

    # the PEFT adapter read back (as plain LoRA) and the toy's own merged export give the same logits
    from jaxtune.spine.model import load_model_with_adapter

    merged = export_run(run, "merged", tmp_path / "merged")
    cfg, with_adapter, lora = load_model_with_adapter(model, adapter)
    tokens = jnp.arange(40).reshape(2, 20) % cfg.vocab_size
    np.testing.assert_allclose(forward(load_model(merged)[1], tokens, cfg), forward(with_adapter, tokens, cfg,
                                                                                     method=lora), atol=2e-4)
    assert np.abs(np.asarray(forward(load_model(model)[1], tokens, cfg)
                             - forward(with_adapter, tokens, cfg, method=lora))).max() > 1e-3  # it trained

    # planned: the estimate counts the toy's leaves as what trains, and its x A saved activations
    plan = TrainPlan(config.method, batch_size=4, seq_len=96, param_dtype="float32",
                     forward=ForwardOptions(compute_dtype="float32"))
    est = estimate(cfg, plan, get_device("cpu"))
    L, D = cfg.num_layers, cfg.hidden_size
    assert est.trainable_parameters == L * 4 * ((D + cfg.q_size) + (D + cfg.kv_size))
    full = estimate(cfg, replace(plan, method=method_config("full")), get_device("cpu"))
    assert est.trainable_parameters < full.trainable_parameters


def test_an_objective_from_a_test_trains_and_is_planned(toys, model_and_data, tmp_path):
    """The toy's [sft_scaled] section is read from the TOML like any objective's (factor 3: the first loss is 3 x
    SFT's), written back by `dump_run_config`, and the planner counts it as SFT."""
    from jaxtune.run_config import dump_run_config

    model, data = model_and_data
    once = run_config(tmp_path, model, data, "lora", "sft", steps=2)
    thrice = run_config(tmp_path, model, data, "lora", "sft_scaled", steps=2, extra=("[sft_scaled]", "factor = 3.0"))
    assert thrice.section("sft_scaled") == ScaledConfig(3.0) and "[sft_scaled]" in dump_run_config(thrice)
    fine_tune(once, log=lambda _: None)
    fine_tune(thrice, log=lambda _: None)
    first = train_losses(tmp_path / "lora-sft")[0], train_losses(tmp_path / "lora-sft_scaled")[0]
    np.testing.assert_allclose(first[1], 3 * first[0], rtol=1e-5)
    cfg = load_model(model)[0]
    plan = TrainPlan(thrice.method, batch_size=4, seq_len=96, objective="sft_scaled")
    assert estimate(cfg, plan, get_device("cpu")).total_bytes == estimate(
        cfg, replace(plan, objective="sft"), get_device("cpu")).total_bytes


def test_a_kernel_from_a_test_runs_the_forward_and_is_planned(toys, monkeypatch):
    """attention = "toy_dense": the forward's logits and gradients equal the blockwise kernel's; where the toy runs
    natively (its platforms), the planner counts its declared workspace and passes in place of the blockwise
    kernel's."""
    cfg = tiny_model_config(initializer_range=0.1)
    params = init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
    segments = jnp.asarray(np.repeat([[1] * 10 + [2] * 10 + [0] * 4], 2, axis=0), jnp.int32)

    def logits_and_grads(attention):
        logits = lambda p: forward(p, tokens, cfg, segment_ids_BxT=segments,
                                   options=ForwardOptions(attention=attention))
        return jax.jit(lambda p: (logits(p), jax.grad(lambda p: jnp.sum(logits(p) ** 2))(p)))(params)

    (want, want_grads), (got, got_grads) = logits_and_grads("blockwise"), logits_and_grads("toy_dense")
    real = np.asarray(segments > 0)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5, atol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):  # float32 rounding of O(100) values
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-6 * float(np.abs(w).max()))

    plan = TrainPlan(method_config("lora", rank=4), batch_size=2, seq_len=256, param_dtype="float32",
                     forward=ForwardOptions(compute_dtype="float32", attention="toy_dense"))
    blockwise = estimate(cfg, plan, get_device("cpu"))
    blockwise_flops = step_time(blockwise).flops
    assert blockwise.attention_bytes == estimate(cfg, plan.replace(attention="blockwise"),
                                                 get_device("cpu")).attention_bytes  # not native on CPU
    monkeypatch.setitem(KERNELS, TOY_KERNEL.name, dataclasses.replace(TOY_KERNEL, platforms=("cpu",)))
    est = estimate(cfg, plan, get_device("cpu"))
    assert blockwise.peak_phase == est.peak_phase == "backward"
    toy_bytes = toy_workspace(2, cfg.num_heads, plan.seq_len, plan.seq_len, 4)
    assert est.attention_bytes == toy_bytes != blockwise.attention_bytes
    assert est.total_bytes - blockwise.total_bytes == toy_bytes - blockwise.attention_bytes
    assert step_time(est).flops > blockwise_flops  # its 4 passes, not the blockwise kernel's 3
