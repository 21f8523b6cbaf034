"""Several LoRA adapters in one generation batch: each row's logits and greedy tokens equal running its adapter alone
(PEFT adapter directories written by jaxtune's export, of different ranks, alphas, rsLoRA and targets), the stacks'
layout, `jaxtune generate --data` with named adapters, and the errors for what cannot mix or bad requests."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import numpy_random_params

from jaxtune.cli import main
from jaxtune.completions import read_requests
from jaxtune.config import SamplingConfig, tiny_config
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.generation import generate, generate_text
from jaxtune.methods import method_config
from jaxtune.methods.lora.layout import lora_layout
from jaxtune.methods.lora.rows import stack_adapters
from jaxtune.methods.peft import save_peft_adapter
from jaxtune.methods.transform import apply_method
from jaxtune.models.kv_cache import prefill
from jaxtune.presets import write_random_model
from jaxtune.spine.model import load_adapters, load_model, load_model_with_adapter

jit_prefill = jax.jit(prefill, static_argnames=("cfg", "cache_size", "method", "options"))

# Different ranks, alphas, scalings and targets: a and b share v_proj, each adapts modules the other does not.
METHODS = {
    "a": method_config("lora", rank=4, alpha=8.0, target_modules=("q_proj", "v_proj")),
    "b": method_config("lora", rank=8, alpha=4.0, rslora=True, target_modules=("v_proj", "up_proj", "down_proj"),
                      rank_pattern=(("down_proj", 2),)),
    "c": method_config("lora", rank=2, alpha=16.0, target_modules=("o_proj", "gate_proj"), layers_to_transform=(1,)),
}
GREEDY = SamplingConfig(max_new_tokens=10)


def random_lora(params: dict, seed: int) -> dict:
    """Non-zero LoRA A and B (PEFT's init leaves B at zero, which would make every comparison vacuous); A keeps its
    zeros beyond a layer's rank."""
    keys = iter(jax.random.split(jax.random.key(seed), 32))
    layers = {name: {**m, "lora_a": m["lora_a"] * (1 + jax.random.uniform(next(keys), m["lora_a"].shape)),
                     "lora_b": 0.5 * jax.random.normal(next(keys), m["lora_b"].shape)}
              if isinstance(m, dict) and "lora_b" in m else m for name, m in params["layers"].items()}
    return {**params, "layers": layers}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random llama and three LoRA adapters exported by jaxtune as PEFT directories beside it."""
    root = tmp_path_factory.mktemp("adapter_rows")
    model = write_random_model(root / "model", "llama", seed=3)
    cfg, base = load_model(model)
    for i, (name, method) in enumerate(METHODS.items()):
        params = random_lora(apply_method(base, cfg, method, jax.random.key(i)), seed=10 + i)
        save_peft_adapter(root / name, params, cfg, method, base_model=str(model))
    return model


@pytest.mark.full
def test_stacks_fold_each_scale_pad_ranks_and_zero_the_base_slot():
    """Slot 0 zeros; slot i adapter i's A (padded to the module's largest rank) and alpha/r (rsLoRA alpha/sqrt(r))
    times its B, per layer; a module an adapter skips holds zeros in its slot."""
    cfg = tiny_config(num_layers=2)
    base = numpy_random_params(cfg)
    adapted = {name: (m, random_lora(apply_method(base, cfg, m, jax.random.key(i)), i))
               for i, (name, m) in enumerate(METHODS.items())}
    stacked = stack_adapters(adapted, cfg)
    v = stacked["layers"]["v_proj"]
    assert v["stack_a"].shape == (2, 4, cfg.hidden_size, 8) and v["stack_b"].shape == (2, 4, 8, cfg.kv_size)
    assert not np.any(v["stack_a"][:, 0]) and not np.any(v["stack_b"][:, 0]) and not np.any(v["stack_b"][:, 3])
    for slot, name in ((1, "a"), (2, "b")):
        method, params = adapted[name]
        scale_L = lora_layout(method, cfg.layer_stacks())["v_proj"].scales
        r = method.rank
        np.testing.assert_array_equal(v["stack_a"][:, slot, :, :r], params["layers"]["v_proj"]["lora_a"])
        assert not np.any(v["stack_a"][:, slot, :, r:])
        np.testing.assert_allclose(v["stack_b"][:, slot, :r], scale_L[:, None, None]
                                   * np.asarray(params["layers"]["v_proj"]["lora_b"]), rtol=1e-6)
    assert lora_layout(METHODS["b"], cfg.layer_stacks())["v_proj"].scales[0] == pytest.approx(4 / 8**0.5)
    assert "stack_a" not in stacked["layers"]["k_proj"] and "lora_a" not in stacked["layers"]["q_proj"]


@pytest.mark.parity
@pytest.mark.full
def test_mixed_batch_equals_each_adapter_alone(model_dir):
    """Rows of adapters a, b, c and the base in one batch: prefill logits within 1e-5 of each adapter's own batch
    (PEFT directories loaded by name) and the same greedy tokens; every adapter changes its rows' logits."""
    root = model_dir.parent
    cfg, stacked, slots = load_adapters(model_dir, {name: root / name for name in METHODS})
    assert slots == {"a": 1, "b": 2, "c": 3}
    alone = {0: (load_model(model_dir)[1], None)}
    for name in METHODS:
        _, params, method = load_model_with_adapter(model_dir, root / name)
        alone[slots[name]] = (params, method)
    tokenizer = Tokenizer.byte_level()
    texts = ["The cat", "Once upon a time there", "1, 2, 3,", "Hello", "abc abc", "Q: why?\nA:", "x", "Lo"]
    rows = [1, 2, 0, 3, 2, 1, 3, 0]
    ids = [tokenizer.encode(t) for t in texts]
    T = max(map(len, ids))
    tokens = np.zeros((len(ids), T), np.int32)
    mask = np.zeros_like(tokens)
    for i, p in enumerate(ids):
        tokens[i, T - len(p):], mask[i, T - len(p):] = p, 1
    mixed, _ = jit_prefill(stacked, tokens, cfg, mask, adapter_B=jnp.asarray(rows, jnp.int32))
    each = {slot: np.asarray(jit_prefill(params, tokens, cfg, mask, method=method)[0])
            for slot, (params, method) in alone.items()}
    for i, slot in enumerate(rows):
        np.testing.assert_allclose(mixed[i], each[slot][i], atol=1e-5, rtol=0)
        if slot:
            assert np.max(np.abs(each[slot][i] - each[0][i])) > 1e-2  # the adapter matters
    new = generate(stacked, cfg, ids, GREEDY, adapter_of_row=rows)
    reference = {slot: generate(params, cfg, ids, GREEDY, method=method) for slot, (params, method) in alone.items()}
    assert new == [reference[slot][i] for i, slot in enumerate(rows)]
    assert any(reference[slot][i] != reference[0][i] for i, slot in enumerate(rows) if slot)


def requests_file(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.full
def test_cli_generate_data_with_two_named_adapters(model_dir, tmp_path, capsys):
    """`generate --data` with --adapter a=DIR --adapter b=DIR: one answer per request in input order, each the
    completion of its adapter alone (the base without one), cut by its own stop strings and max_new_tokens."""
    root = model_dir.parent
    records = [{"prompt": "The cat", "adapter": "a"},
               {"messages": [{"role": "user", "content": "Hi"}], "adapter": "b", "max_new_tokens": 4},
               {"prompt": "Once upon", "stop": ["e"]},
               {"prompt": "1, 2,", "adapter": "b"}]
    data = requests_file(tmp_path / "requests.jsonl", records)
    out = tmp_path / "answers.jsonl"
    argv = ["generate", "--model", str(model_dir), "--data", str(data), "--adapter", f"a={root / 'a'}",
            "--adapter", f"b={root / 'b'}", "--max-new-tokens", "8"]
    assert main(argv + ["--out", str(out)]) == 0
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert main(argv) == 0  # default: stdout
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == answers
    tokenizer = Tokenizer.byte_level()
    expected = []
    for record in records:
        adapter = record.get("adapter")
        cfg, params, method = load_model_with_adapter(model_dir, root / adapter if adapter else None)
        prompt = record.get("prompt", record.get("messages"))
        text = generate_text(params, cfg, tokenizer, [prompt], SamplingConfig(record.get("max_new_tokens", 8)),
                             stop_strings=record.get("stop", []), method=method)[0]
        expected.append({"prompt" if "prompt" in record else "messages": prompt, "adapter": adapter,
                         "completion": text})
    assert answers == expected
    assert "e" not in answers[2]["completion"]


@pytest.mark.parametrize("record, key", [
    ({"prompt": "x", "adapter": "nope"}, "adapter"),
    ({"prompt": 3}, "prompt"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"prompt": "x", "stop": "e"}, "stop"),
    ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
    ({"input": "x"}, "'prompt'"),
])
def test_bad_requests_name_the_line_and_key(tmp_path, record, key):
    data = requests_file(tmp_path / "r.jsonl", [{"prompt": "fine", "adapter": "a"}, record])
    with pytest.raises(JaxtuneError, match=rf"^{data}:2: .*{key}") as error:
        read_requests(data, ("a",))
    assert "\n" not in str(error.value)


def test_cli_unknown_adapter_name_is_one_line(model_dir, tmp_path, capsys):
    data = requests_file(tmp_path / "r.jsonl", [{"prompt": "x", "adapter": "b"}])
    assert main(["generate", "--model", str(model_dir), "--data", str(data), "--adapter",
                 f"a={model_dir.parent / 'a'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"jaxtune: error: {data}:1: key 'adapter': unknown adapter \"b\"") and "\n" not in err


def test_what_cannot_mix_is_refused(model_dir, tmp_path):
    """DoRA, IA3, another quantised base or another base model: one line naming the adapter."""
    cfg, base = load_model(model_dir)
    for name, method in {"dora": method_config("lora", rank=2, dora=True),
                         "ia3": method_config("ia3")}.items():
        save_peft_adapter(tmp_path / name, apply_method(base, cfg, method, jax.random.key(0)), cfg, method)
        with pytest.raises(JaxtuneError, match=f"^adapter {name}: .*cannot share a batch"):
            load_adapters(model_dir, {"a": model_dir.parent / "a", name: tmp_path / name})
    for name, change in {"nf4": {"jaxtune_quantized_base": {"bits": 4, "double_quant": True, "format": "nf4"}},
                         "other": {"base_model_name_or_path": "org/Other-7B"}}.items():
        shutil.copytree(model_dir.parent / "b", tmp_path / name)
        config = json.loads((tmp_path / name / "adapter_config.json").read_text())
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(JaxtuneError, match=f"^adapters a and {name} differ in their base"):
            load_adapters(model_dir, {"a": model_dir.parent / "a", name: tmp_path / name})


def test_adapter_slots_must_fit_the_stacks(model_dir):
    cfg, stacked, _ = load_adapters(model_dir, {"a": model_dir.parent / "a"})
    ids = [[1, 5, 9]]
    for kwargs, message in (({}, "name each prompt's slot"), ({"adapter_of_row": [2]}, r"in \[0, 2\)"),
                            ({"adapter_of_row": [0, 1]}, "2 entries for 1 prompts"),
                            ({"adapter_of_row": [1], "method": METHODS["a"]}, "pass no method")):
        with pytest.raises(JaxtuneError, match=message):
            generate(stacked, cfg, ids, GREEDY, **kwargs)
    with pytest.raises(JaxtuneError, match="no adapter stacks"):
        generate(load_model(model_dir)[1], cfg, ids, GREEDY, adapter_of_row=[0])


@pytest.mark.reference
@pytest.mark.parity
def test_mixed_batch_equals_peft_adapter_names(model_dir):
    """PEFT's own mixed-batch inference (`adapter_names=[...]` per row, "__base__" for none) on the same adapter
    directories: the last prompt token's logits and the greedy tokens equal jaxtune's stacked batch."""
    import torch
    import transformers
    from peft import PeftModel

    root = model_dir.parent
    cfg, stacked, slots = load_adapters(model_dir, {name: root / name for name in METHODS})
    peft_model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(model_dir), root / "a",
                                           adapter_name="a")
    for name in ("b", "c"):
        peft_model.load_adapter(root / name, adapter_name=name)
    peft_model.eval()
    tokenizer = Tokenizer.byte_level()
    ids = [tokenizer.encode(t) for t in ("The cat", "Once upon a time", "1, 2, 3,", "Hello", "Q: why?\nA:", "ab")]
    names = ["a", "b", "__base__", "c", "b", "a"]
    rows = [slots.get(n, 0) for n in names]
    T = max(map(len, ids))
    tokens, mask = np.zeros((len(ids), T), np.int64), np.zeros((len(ids), T), np.int64)
    for i, p in enumerate(ids):
        tokens[i, T - len(p):], mask[i, T - len(p):] = p, 1
    with torch.no_grad():
        ref = peft_model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                         adapter_names=names).logits[:, -1].numpy()
        ref_new = peft_model.generate(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                                      adapter_names=names, do_sample=False, max_new_tokens=GREEDY.max_new_tokens,
                                      eos_token_id=list(cfg.eos_token_id), pad_token_id=0)[:, T:].tolist()
    got, _ = jit_prefill(stacked, tokens.astype(np.int32), cfg, mask.astype(np.int32),
                         adapter_B=jnp.asarray(rows, jnp.int32))
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-4, rtol=0)
    base_logits = np.asarray(jit_prefill(load_model(model_dir)[1], tokens.astype(np.int32), cfg,
                                         mask.astype(np.int32))[0])
    assert all(np.abs(ref[i] - base_logits[i]).max() > 1e-2 for i, r in enumerate(rows) if r)
    eos = set(cfg.eos_token_id)
    cut = [row[: next((j for j, t in enumerate(row) if t in eos), len(row))] for row in ref_new]
    assert generate(stacked, cfg, ids, GREEDY, adapter_of_row=rows) == cut
