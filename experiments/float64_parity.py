"""How far are jaxtune's and transformers/PEFT's float32 logits from the same model computed in float64?

    python experiments/float64_parity.py                  # this CPU (~2 min)
    XLA_FLAGS=--xla_cpu_max_isa=AVX2 ATEN_CPU_CAPABILITY=avx2 python experiments/float64_parity.py   # as on Zen 3

For the tests' tiny random models (every architecture) and adapters (PEFT's LoRA variants, IA3, prefix tuning and
the wild fields), over several random padded batches: jaxtune in float64 against the float64 reference (the same
function: ~1e-14), and each framework's float32 relative L2 error from the reference with their ratio. LoRA's
weights are perturbed as the tests do (0.3 / sqrt(fan-in): deltas of the size training gives) and, for three
adapters, as the tests did before (0.3 flat: deltas several times the base weights), which makes attention peaked
and a float32 comparison between frameworks a lottery of last-bit differences (see tests/reference.py).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from hf_models import ARCHS, make_hf_model  # noqa: E402
from peft import get_peft_model  # noqa: E402
from reference import float64_reference, logits_four_ways, relative_error  # noqa: E402
from test_methods_peft import METHODS, WILD  # noqa: E402

from jaxtune.methods.peft import load_peft_adapter  # noqa: E402
from jaxtune.spine.model import load_model  # noqa: E402

SEEDS = range(6)


def errors(torch_model, params, cfg, method=None) -> dict:
    """Worst float64 difference, and per batch the float32 relative errors of both frameworks."""
    reference = float64_reference(torch_model)
    worst64, ours, theirs, max_abs = 0.0, [], [], 0.0
    for seed in SEEDS:
        logits = logits_four_ways(torch_model, params, cfg, method, seed, reference)
        ref32, ref64, out32, out64, valid = (logits[k] for k in ("ref32", "ref64", "out32", "out64", "valid"))
        worst64 = max(worst64, float(np.abs(out64 - ref64)[valid].max()))
        ours.append(relative_error(out32, ref64, valid))
        theirs.append(relative_error(ref32, ref64, valid))
        max_abs = max(max_abs, float(np.abs(out32 - ref32)[valid].max()))
    ratios = np.asarray(ours) / np.asarray(theirs)
    return {"float64": worst64, "ours": max(ours), "theirs": max(theirs), "ratio_min": ratios.min(),
            "ratio_max": ratios.max(), "max_abs": max_abs}


def perturb(peft_model, scale_by_fan_in: bool):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if p.requires_grad:
                lora = ("lora_A" in name or "lora_B" in name) and p.ndim == 2
                p.add_((0.3 / np.sqrt(p.shape[-1]) if lora and scale_by_fan_in else 0.3) * torch.randn_like(p))
    return peft_model.eval()


def row(name: str, e: dict) -> str:
    return (f"| {name} | {e['float64']:.1e} | {e['ours']:.2e} | {e['theirs']:.2e} | "
            f"{e['ratio_min']:.2f} – {e['ratio_max']:.2f} | {e['max_abs']:.1e} |")


def main() -> None:
    root = Path(tempfile.mkdtemp())
    print("| model / adapter | jaxtune float64 vs reference (max abs) | jaxtune float32 error | "
          "reference framework float32 error | ratio per batch | max abs float32 difference |")
    print("|---|---|---|---|---|---|")
    bases = {}
    for arch in ARCHS:
        model = make_hf_model(arch, root / arch)
        bases[arch] = load_model(root / arch)
        print(row(f"{arch} (transformers)", errors(model, bases[arch][1], bases[arch][0])))
    configs = {name: ("llama", peft_config) for name, (_, peft_config) in METHODS.items()} | WILD
    for scale_by_fan_in in (True, False):
        for name, (arch, peft_config) in configs.items():
            if not scale_by_fan_in and name not in ("rslora", "lora_all_linear", "dora"):
                continue
            cfg, params = bases[arch]
            peft_model = perturb(get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(root / arch),
                                                peft_config), scale_by_fan_in)
            adapter = root / f"{name}-{scale_by_fan_in}"
            peft_model.save_pretrained(adapter)
            method, loaded = load_peft_adapter(adapter, params, cfg)
            label = f"{name} (PEFT)" if scale_by_fan_in else f"{name} (PEFT, the old tests' large LoRA weights)"
            print(row(label, errors(peft_model, loaded, cfg, method)))


if __name__ == "__main__":
    main()
