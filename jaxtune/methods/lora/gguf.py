"""A LoRA adapter as llama.cpp's GGUF LoRA (`save_gguf_lora`, the unit's `gguf_lora`), for the base model
`methods.gguf_export.save_gguf` writes: `llama-cli -m model.gguf --lora adapter.gguf`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxtune.config import ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.methods.gguf_export import gguf_form, gguf_tensor_name
from jaxtune.methods.lora.layout import lora_layout, module_scales
from jaxtune.methods.lora.options import LoRAConfig
from jaxtune.models.gguf import permute_qk
from jaxtune.models.hf_weights import hf_module_path, stored_name


def save_gguf_lora(path: str | Path, cfg: ModelConfig, params: dict, method: LoRAConfig,
                   name: str = "jaxtune adapter") -> Path:
    """A LoRA adapter as llama.cpp's GGUF LoRA (`llama-cli --lora`, `llama_adapter_lora_init`), for the base model
    written by `save_gguf`: for each adapted module and layer `blk.{i}.{module}.weight.lora_a` [r, in] and `.lora_b`
    [out, r] (torch's layout, float32; a Llama's q/k rows of B interleaved as its base weight's). LoRA's scale is
    folded into B and `adapter.lora.alpha` is 0, so llama.cpp adds B A at its adapter scale (1 by default) whatever
    the rank and alpha patterns; layers an adapter skips get no tensors."""
    import gguf

    if method.dora or method.lora_bias or method.modules_to_save or method.target_parameters:
        raise JaxtuneError("a GGUF LoRA adapter holds plain LoRA only (no DoRA, LoRA bias, modules_to_save or "
                           "expert targets); export --gguf merges any adapter into the model instead")
    form = gguf_form(cfg)
    layers = params["layers"]
    modules = [m for m in layers if isinstance(layers[m], dict) and "lora_a" in layers[m]]
    if set(modules) & set(form.unadapted):
        raise JaxtuneError(f"{cfg.architecture}: llama.cpp applies no GGUF LoRA to "
                           f"{', '.join(m for m in modules if m in form.unadapted)} (its {form.arch} graph multiplies "
                           "them plainly); export --gguf merges the adapter into the model instead")
    if unwritten := [m for m in modules if form.lora_unwritten and m.startswith(form.lora_unwritten)]:
        raise JaxtuneError(f"{cfg.architecture}: a GGUF LoRA on {', '.join(unwritten)} is not written here (llama.cpp "
                           "holds those projections reordered or split); export --gguf merges the adapter into the "
                           "model instead")
    layout = lora_layout(method, cfg.layer_stacks(tuple(modules)))
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}
    writer = gguf.GGUFWriter(str(path), form.arch)
    writer.add_name(name)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 0.0)
    for module in modules:
        a_LxIxR, b_LxRxO = np.asarray(layers[module]["lora_a"], np.float32), np.asarray(layers[module]["lora_b"],
                                                                                          np.float32)
        layer_of = cfg.module_layers(module)  # a stack's row -> its layer (DeepSeek's shared experts: from 1)
        scales = np.asarray(module_scales(method, module, layer_of))
        for i, rank in enumerate(layout[module].ranks):
            if not rank:
                continue
            b_OxR = (b_LxRxO[i, :rank] * scales[i]).T
            if form.permuted_qk and module in heads:
                b_OxR = permute_qk(b_OxR, heads[module])
            stem = gguf_tensor_name(stored_name(f"model.layers.{layer_of[i]}.{hf_module_path(module)}.weight", cfg),
                                    form)
            writer.add_tensor(f"{stem}.lora_a", np.ascontiguousarray(a_LxIxR[i, :, :rank].T))
            writer.add_tensor(f"{stem}.lora_b", np.ascontiguousarray(b_OxR))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
