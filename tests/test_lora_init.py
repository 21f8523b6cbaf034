"""LoRA initialisations from the weights (`method.init`: pissa, olora, loftq) against PEFT 0.21's own
`init_lora_weights` on the real SmolLM2-135M (its GGUF, dequantised to float32 and given to both), and PiSSA/OLoRA
adapters trained by `jaxtune train` loading in PEFT onto the original base with jaxtune's logits.

A singular vector is unique up to its sign, which torch's and JAX's LAPACK builds pick differently for some
components: A and B are compared after flipping each of jaxtune's rank components (a row of A with the matching
column of B) to PEFT's sign; their product, the base and training do not depend on it.
"""

import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import peft.utils.loftq_utils as loftq_utils
import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from test_quant import ref_dequantize_nf4, ref_quantize_nf4
from test_train import DEMO_DATA, write_config

from jaxtune.demo import smollm2_path
from jaxtune.errors import ConfigError
from jaxtune.methods import method_config
from jaxtune.methods.lora.init import init_layer, initialise
from jaxtune.methods.transform import apply_method, combine
from jaxtune.models.hf_config import load_config
from jaxtune.models.hf_weights import checked_reader, stored_dtype
from jaxtune.models.llama import forward
from jaxtune.models.quant import dequantize
from jaxtune.parallel.mesh import make_mesh
from jaxtune.presets import write_random_model
from jaxtune.run_config import load_run_config
from jaxtune.spine.load import read_tree
from jaxtune.spine.model import load_model, load_model_with_adapter
from jaxtune.spine.run import abstract_run, train_plan
from jaxtune.train.checkpoint import Checkpoints
from jaxtune.train.loop import fine_tune

pytestmark = [pytest.mark.parity, pytest.mark.reference]  # also run with AVX2 forced (.ci/run)
TOL = 1e-5


@pytest.fixture(scope="module")
def smollm2():
    """(cfg, float32 params) of the real SmolLM2-135M-Instruct, its Q4_1/Q8_0 blocks dequantised."""
    return load_model(smollm2_path(), dtype=np.float32)


class _One(torch.nn.Module):
    """One nn.Linear holding a weight [out, in], for PEFT to adapt."""

    def __init__(self, w_OxI: np.ndarray):
        super().__init__()
        self.proj = torch.nn.Linear(w_OxI.shape[1], w_OxI.shape[0], bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.tensor(w_OxI))


def peft_init(w_IxO: np.ndarray, init: str, rank: int, alpha: float, **kwargs) -> tuple:
    """PEFT's (lora_A [r, in], lora_B [out, r], base weight [out, in]) for jaxtune's kernel [in, out]."""
    model = get_peft_model(_One(np.ascontiguousarray(w_IxO.T)), LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=["proj"], init_lora_weights=init, **kwargs))
    layer = model.base_model.model.proj
    return tuple(t.detach().numpy() for t in (layer.lora_A["default"].weight, layer.lora_B["default"].weight,
                                               layer.base_layer.weight))


def _distance(a_RxI, b_OxR, ref_a_RxI, ref_b_OxR) -> float:
    """Largest difference of A and B from the reference's, each rank component's sign aligned."""
    sign_R = np.sign(np.sum(a_RxI * ref_a_RxI, axis=1))
    return max(np.abs(a_RxI * sign_R[:, None] - ref_a_RxI).max(), np.abs(b_OxR * sign_R - ref_b_OxR).max())


def exact_svd_factors(w_OxI: np.ndarray, rank: int, scale: float) -> tuple:
    """PiSSA's (and LoftQ's, scale 1) A [r, in] and B [out, r] from the float64 SVD of w."""
    u, s, vh = np.linalg.svd(w_OxI.astype(np.float64), full_matrices=False)
    root = np.sqrt(s[:rank] / scale)
    return root[:, None] * vh[:rank], u[:, :rank] * root


def assert_same_init(a_IxR, b_RxO, ref_a_RxI, ref_b_OxR, exact=None):
    """jaxtune's A and B equal PEFT's to 1e-5, each rank component's sign aligned; or, where float32 SVDs of
    close singular values differ by more (`exact`: the float64 factors), are within twice PEFT's own error of the
    exact ones or within 4e-5 of them (XLA's float32 SVD differs by CPU: one element of one SmolLM2 layer's PiSSA B
    is 1.2e-5 off the exact value on an Intel Xeon, 2.0e-5 on an AMD Zen 4, where PEFT's is 1.2e-6 and 5.6e-6);
    their product B A equals PEFT's to 1e-5 either way."""
    a_RxI, b_OxR = np.asarray(a_IxR).T, np.asarray(b_RxO).T
    if _distance(a_RxI, b_OxR, ref_a_RxI, ref_b_OxR) <= TOL:
        return
    assert exact is not None, _distance(a_RxI, b_OxR, ref_a_RxI, ref_b_OxR)
    assert _distance(a_RxI, b_OxR, *exact) <= max(2 * _distance(ref_a_RxI, ref_b_OxR, *exact), 4 * TOL)
    np.testing.assert_allclose(b_OxR @ a_RxI, ref_b_OxR @ ref_a_RxI, atol=TOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("init, module", [("pissa", "q_proj"), *(pytest.param(i, m, marks=pytest.mark.full) for i, m in
                                                               (("olora", "q_proj"), ("pissa", "down_proj"),
                                                                ("olora", "down_proj")))])
def test_init_equals_peft_on_a_real_smollm2_layer(smollm2, init, module):
    """Layer 3's q_proj [576, 576] and down_proj [1536 -> 576] of SmolLM2, rank 8, alpha 16: A, B and the changed
    base equal PEFT's to 1e-5."""
    cfg, params = smollm2
    w_IxO = np.asarray(params["layers"][module]["kernel"][3])
    method = method_config("lora", rank=8, alpha=16, init=init, target_modules=(module,))
    a, b, base = init_layer(jnp.asarray(w_IxO), 8, method.lora_scale, method)
    ref_a, ref_b, ref_base = peft_init(w_IxO, init, 8, 16)
    assert_same_init(a, b, ref_a, ref_b, exact_svd_factors(w_IxO.T, 8, 2.0) if init == "pissa" else None)
    np.testing.assert_allclose(np.asarray(base).T, ref_base, atol=TOL, rtol=0)
    assert np.abs(ref_base - w_IxO.T).max() > 0.1  # the base did change


@pytest.mark.slow
@pytest.mark.parametrize("init", [pytest.param("pissa", marks=pytest.mark.full), "olora"])
def test_layer_stacked_init_equals_peft_layer_by_layer(smollm2, init):
    """`initialise` on SmolLM2's stacked v_proj kernel [30, 576, 192] with rsLoRA and a rank_pattern giving layer 1
    rank 2 (padded to 4) and layers_to_transform skipping layer 2: each layer equals PEFT's init of that layer with
    its own rank and scale; the padding is zero and a skipped layer keeps its weights."""
    cfg, params = smollm2
    method = method_config("lora", rank=4, alpha=8, rslora=True, init=init, target_modules=("v_proj",),
                          layers_to_transform=tuple(i for i in range(cfg.num_layers) if i != 2),
                          rank_pattern={"layers.1.self_attn.v_proj": 2})
    changed, initial = initialise(params, cfg, method)
    kernel = np.asarray(params["layers"]["v_proj"]["kernel"])
    a, b = (np.asarray(initial["v_proj"][k]) for k in ("lora_a", "lora_b"))
    base = np.asarray(changed["layers"]["v_proj"]["kernel"])
    assert a.shape == (30, 576, 4) and b.shape == (30, 4, 192)
    for i in range(cfg.num_layers):
        if i == 2:
            np.testing.assert_array_equal(base[i], kernel[i])
            assert not a[i].any() and not b[i].any()
            continue
        r = 2 if i == 1 else 4
        ref_a, ref_b, ref_base = peft_init(kernel[i], init, r, 8, use_rslora=True)
        exact = exact_svd_factors(kernel[i].T, r, 8 / r**0.5) if init == "pissa" else None
        assert_same_init(a[i, :, :r], b[i, :r], ref_a, ref_b, exact)
        assert not a[i, :, r:].any() and not b[i, r:].any()
        # the base is W - s B A, s = 8 / sqrt(r): B A within 1e-5 of PEFT's (assert_same_init) moves it s times that
        np.testing.assert_allclose(base[i].T, ref_base, atol=TOL * 8 / r**0.5, rtol=0)


def _bnb_stand_in() -> types.ModuleType:
    """The two bitsandbytes calls of PEFT's `loftq_init` (4-bit, no double quantisation), computed by test_quant's
    numpy restatement of bitsandbytes 0.50 (not by jaxtune)."""

    class Params4bit:
        def __init__(self, data, requires_grad=False, compress_statistics=False, quant_type="nf4"):
            assert quant_type == "nf4" and not compress_statistics
            w_OxI = data.numpy()
            self.data, self.quant_state = ref_quantize_nf4(w_OxI.T, double_quant=False), w_OxI.T.shape

        def to(self, device):
            return self

    def dequantize_4bit(data, shape):
        return torch.tensor(np.ascontiguousarray(ref_dequantize_nf4(data, shape).T))

    bnb = types.ModuleType("bitsandbytes")
    bnb.nn = types.SimpleNamespace(Params4bit=Params4bit)
    bnb.functional = types.SimpleNamespace(dequantize_4bit=dequantize_4bit)
    return bnb


class _Host(torch.Tensor):
    """A CPU tensor that ignores the device PEFT's `loftq_init` moves it to (it computes on "cuda")."""

    def to(self, *args, **kwargs):
        kwargs.pop("device", None)
        return super().to(*[a for a in args if not isinstance(a, (str, torch.device))], **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("loftq_iter", [1, pytest.param(2, marks=pytest.mark.full)])
def test_loftq_equals_peft_loftq_init_on_a_real_smollm2_layer(smollm2, loftq_iter, monkeypatch):
    """QLoRA (NF4, no double quantisation) with init = loftq on SmolLM2's layer-3 o_proj, rank 8: the dequantised
    NF4 base jaxtune holds and B A equal PEFT's `loftq_init` (its own loop and SVDs; bitsandbytes' NF4 from
    test_quant's restatement) to 1e-5, and A and B are within twice PEFT's own float32 error of the exact SVD."""
    monkeypatch.setitem(sys.modules, "bitsandbytes", _bnb_stand_in())
    monkeypatch.setattr(loftq_utils, "is_bnb_available", lambda: True)
    monkeypatch.setattr(loftq_utils, "is_bnb_4bit_available", lambda: True)
    cfg, params = smollm2
    w_IxO = np.asarray(params["layers"]["o_proj"]["kernel"][3])
    weight = torch.tensor(np.ascontiguousarray(w_IxO.T)).as_subclass(_Host)
    ref_base, ref_a, ref_b = (t.as_subclass(torch.Tensor).numpy() for t in loftq_utils.loftq_init(
        weight, num_bits=4, reduced_rank=8, num_iter=loftq_iter))
    method = method_config("qlora", rank=8, alpha=8, init="loftq", loftq_iter=loftq_iter, double_quant=False,
                          target_modules=("o_proj",))
    a, b, base = init_layer(jnp.asarray(w_IxO), 8, method.lora_scale, method)
    np.testing.assert_allclose(np.asarray(dequantize(base)).T, ref_base, atol=TOL, rtol=0)
    # The residual's singular values lie close together (quantisation noise), so its singular vectors differ
    # between LAPACK builds by ~3e-5: A and B are as close to the float64 SVD of the same residual as PEFT's own.
    assert_same_init(a, b, ref_a, ref_b, exact_svd_factors(w_IxO.T - ref_base, 8, 1.0))
    # Q + B A is closer to W than Q alone (LoftQ's point; rank 8 of 576 takes a few percent of the noise)
    assert np.linalg.norm(ref_base + ref_b @ ref_a - w_IxO.T) < 0.97 * np.linalg.norm(ref_base - w_IxO.T)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("init")
    model = write_random_model(root / "model", "llama", seed=0, initializer_range=0.1)
    data = root / "data.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:48]))
    return root, model, data


def _trained_params(run_dir, model, config):
    """The run's model as it trained: its last checkpoint's adapter on the base it read (changed by the init)."""
    cfg = load_config(model)
    run = abstract_run(cfg, train_plan(config, stored_dtype(model)), make_mesh(), config.train, total_steps=6)
    trainable = Checkpoints(run_dir / "checkpoints", keep=1, read_only=True).restore_params(6, run.state["params"])
    with checked_reader(model, cfg) as reader:
        frozen = read_tree(reader, run.frozen, cfg, config.method)
    return cfg, combine(trainable, frozen)


@pytest.mark.slow
@pytest.mark.parametrize("init", ["pissa", "olora"])
@pytest.mark.full
def test_trained_adapter_loads_in_peft_on_the_original_base_with_jaxtune_logits(tiny, tmp_path, init):
    """`jaxtune train` with init = pissa/olora (rank 4, alpha 8, all-linear, rank_pattern on v_proj), 6 steps: the
    run's model (changed base + trained A, B) gives the logits PEFT gives with the exported adapter (a plain LoRA
    of rank 2r, alpha doubled, as PEFT's conversion writes it) on the original, unchanged base."""
    root, model, data = tiny
    path = write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=6, eval_every=6)
    config = load_run_config(path, [f'method.init="{init}"', "method.alpha=8",
                                    'method.rank_pattern={"v_proj" = 2}'])
    result = fine_tune(config, log=lambda _: None)
    saved = json.loads((result.result_path / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], saved["rank_pattern"], saved["init_lora_weights"]) == (
        8, 16, {"v_proj": 4}, True)
    cfg, params = _trained_params(tmp_path / "run", model, config)
    _, original = load_model(model)
    assert np.abs(np.asarray(params["layers"]["q_proj"]["kernel"]) - np.asarray(
        original["layers"]["q_proj"]["kernel"])).max() > 1e-3  # the run trained on a changed base
    ids = jnp.asarray([[5, 17, 42, 99, 3, 250, 7, 11]])
    ours = np.asarray(jax.jit(forward, static_argnames=("cfg", "method"))(params, ids, cfg, method=config.method))
    base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, result.result_path).eval()
    with torch.no_grad():
        theirs = peft_model(torch.tensor(np.asarray(ids))).logits.numpy()
        with peft_model.disable_adapter():
            untrained = peft_model(torch.tensor(np.asarray(ids))).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    assert np.abs(theirs - untrained).max() > 1e-3  # the adapter trained
    cfg, loaded, method = load_model_with_adapter(model, result.result_path)  # jaxtune reads its export back
    mine = jax.jit(forward, static_argnames=("cfg", "method"))(loaded, ids, cfg, method=method)
    np.testing.assert_allclose(np.asarray(mine), theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fields, message", [
    (dict(init="svd"), "init"),
    (dict(init="loftq"), "kind = qlora"),
    (dict(init="pissa", dora=True), "not with dora"),
    (dict(kind="qlora", init="pissa", loftq_iter=2), "is for init = loftq"),
    (dict(kind="qlora", init="loftq", loftq_iter=0), "loftq_iter"),
    (dict(kind="ia3", init="pissa"), "is for"),
])
def test_bad_init_values_are_one_line_config_errors(fields, message):
    with pytest.raises(ConfigError, match=message) as error:
        method_config(**fields)
    assert "\n" not in str(error.value)


@pytest.mark.full
def test_in_memory_apply_method_runs_the_init(tiny):
    """`apply_method` on a float tree: PiSSA's base plus s B A is the original kernel (the model is unchanged at
    step 0), and a QLoRA LoftQ tree holds the NF4 base."""
    from jaxtune.models.quant import NF4Array

    cfg, params = load_model(tiny[1], dtype=np.float32)
    method = method_config("lora", rank=4, alpha=8, init="pissa")
    adapted = apply_method(params, cfg, method, jax.random.key(1))
    q = adapted["layers"]["q_proj"]
    delta = 2.0 * jnp.einsum("lir,lro->lio", q["lora_a"], q["lora_b"])
    np.testing.assert_allclose(q["kernel"] + delta, params["layers"]["q_proj"]["kernel"], atol=1e-5)
    loftq = apply_method(params, cfg, method_config("qlora", rank=4, alpha=4, init="loftq"), jax.random.key(1))
    assert isinstance(loftq["layers"]["q_proj"]["kernel"], NF4Array)


@pytest.mark.slow
@pytest.mark.full
def test_loftq_qlora_run_is_evaluated_on_its_loftq_base(tiny, tmp_path, capsys):
    """`jaxtune train` with kind = qlora, init = loftq (2 iterations): the adapter records its LoftQ base, and
    `jaxtune eval` rebuilds that base from the original weights and reproduces the run's held-out loss."""
    from jaxtune.cli import main

    root, model, data = tiny
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[48:64]))
    path = write_config(tmp_path / "c.toml", model, data, tmp_path / "run", max_steps=4, eval_every=4)
    config = load_run_config(path, ["method.kind=qlora", 'method.init="loftq"', "method.loftq_iter=2",
                                    "method.alpha=4", f"data.eval={held_out}"])
    result = fine_tune(config, log=lambda _: None)
    recorded = json.loads((result.result_path / "adapter_config.json").read_text())["jaxtune_quantized_base"]
    assert recorded == {"bits": 4, "double_quant": True, "format": "nf4", "init": "loftq", "loftq_iter": 2}
    capsys.readouterr()
    assert main(["eval", "--model", str(model), "--adapter", str(result.result_path), "--data", str(held_out),
                 "--max-seq-len", "96", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(result.eval_loss, rel=1e-5)
