"""What a run leaves for users: a PEFT adapter directory, or a Hugging Face model for a full fine-tune — at its end
(`export_result`), or later from any of its checkpoints (`export_run`: a stopped, crashed or still running run), as
one of `EXPORT_TARGETS` (peft, merged, gguf, gguf-lora).

    export_run("runs/my-run", "peft", "my-adapter")             # the latest checkpoint's adapter, in PEFT format
    export_run("runs/my-run", "gguf", "model.gguf", step=200)   # the model as of step 200, merged, for llama.cpp
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from jaxtune.config import MeshConfig, MethodConfig, ModelConfig, OffloadConfig
from jaxtune.data.tokenizer import copy_tokenizer, load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.hub import hub_id_of
from jaxtune.io import storage
from jaxtune.io.storage import is_url
from jaxtune.methods.base import METHODS, method_unit
from jaxtune.methods.gguf_export import save_gguf
from jaxtune.methods.ollama import write_modelfile
from jaxtune.methods.peft import save_peft_adapter
from jaxtune.methods.transform import combine
from jaxtune.models.hf_config import load_config
from jaxtune.models.hf_weights import checked_reader, save_model, stored_dtype
from jaxtune.models.vision.families import vision_family
from jaxtune.models.vision.save import save_vision_language_model
from jaxtune.objectives import objective_named
from jaxtune.parallel.mesh import make_mesh
from jaxtune.paths import check_output_dir
from jaxtune.run_config import RunConfig
from jaxtune.spine.load import initial_leaves, read_frozen
from jaxtune.spine.model import load_model_with_adapter
from jaxtune.spine.run import abstract_run, train_plan
from jaxtune.train.checkpoint import Checkpoints
from jaxtune.train.outputs import checkpoint_directory, local_run_directory
from jaxtune.train.resume import run_config_at

EXPORT_TARGETS = ("peft", "merged", "gguf", "gguf-lora")


def _merged_layer(adapter, params: dict, method: MethodConfig | None, cfg: ModelConfig):
    """`save_model`'s tensor(path, layer) with the adapter merged in; None without an adapter."""
    if adapter is None:
        return None
    assert method is not None  # the adapter's
    unit = method_unit(method)
    if unit.merged_layer is None:
        merging = " and ".join(kind for kind, other in METHODS.items() if other.merged_layer is not None)
        raise JaxtuneError(f"{adapter}: only {merging} adapters merge into the weights, not {method.kind}")
    return unit.merged_layer(params, method, cfg)


def export_merged(model: str | Path, adapter: str | Path | None, out: str | Path, log=None) -> Path:
    """Merge a PEFT LoRA/DoRA adapter into its base and write a Hugging Face model directory (with the tokenizer).

    A QLoRA adapter merges into the float weights (as PEFT merges into a dequantised base: a plain float model).
    Without an adapter the model is written as it loads: a GGUF file becomes the directory transformers makes of
    it (blocks dequantised to float32, the tokenizer and chat template from its metadata).
    """
    cfg, params, method = load_model_with_adapter(model, adapter, base="float", log=log)
    tensor = _merged_layer(adapter, params, method, cfg)
    dtype = str(np.dtype(params["embed_tokens"].dtype))
    family = vision_family(model)
    if family is not None:  # the whole vision-language model: its image side as the checkpoint holds it
        config = family.read_config(model)
        params = {**params, "vision": family.read_params(model, config, params["embed_tokens"].dtype)}
        path = save_vision_language_model(out, model, cfg, params, family, config, dtype, tensor)
    else:
        path = save_model(out, cfg, params, dtype=dtype, tensor=tensor)
    copy_tokenizer(model, path)
    return path


def _refuse_images_in_gguf(model: str | Path) -> None:
    family = vision_family(model)
    if family is not None:
        raise JaxtuneError(f"{model}: a vision-language model ({family.architectures[0]}); llama.cpp reads its image "
                           "side from a separate mmproj GGUF, which jaxtune does not write: export --merged or --peft")


def export_gguf(model: str | Path, adapter: str | Path | None, out: str | Path, kind: str = "f16", log=None) -> Path:
    """A model, with a PEFT LoRA/DoRA adapter merged in when given (a full fine-tune's model directory needs none),
    written as a GGUF file of `kind` (`gguf_export.KINDS`) with its tokenizer and chat template, and an Ollama
    Modelfile beside it (`methods/ollama.py`)."""
    _refuse_images_in_gguf(model)
    cfg, params, method = load_model_with_adapter(model, adapter, base="float", log=log)
    tensor = _merged_layer(adapter, params, method, cfg)
    tokenizer = load_tokenizer(model)
    path = save_gguf(out, cfg, params, tokenizer, kind, tensor=tensor, name=Path(str(model)).stem)
    modelfile = write_modelfile(path, tokenizer, Path(model) / "generation_config.json" if Path(model).is_dir()
                                else None)
    if log is not None:
        log(f"wrote the Ollama Modelfile {modelfile} (ollama create NAME -f {modelfile})")
    return path


def export_gguf_lora(model: str | Path, adapter: str | Path, out: str | Path, log=None) -> Path:
    """A PEFT LoRA adapter as llama.cpp's GGUF LoRA, for `model` written by `export_gguf` (or any GGUF of it)."""
    _refuse_images_in_gguf(model)
    cfg, params, method = load_model_with_adapter(model, adapter, log=log)
    assert method is not None  # the adapter's
    write = method_unit(method).gguf_lora
    if write is None:
        raise JaxtuneError(f"{adapter}: a {method.kind} adapter has no GGUF LoRA form; export --gguf merges it into "
                           "the model instead")
    return write(out, cfg, params, method, name=Path(str(adapter)).name)


def export_result(run_dir: Path, config: RunConfig, cfg: ModelConfig, params: dict, method: MethodConfig,
                  initial: dict | None = None) -> Path:
    """run_dir/adapter, or for a full fine-tune run_dir/model: an HF directory with the base's tokenizer, in
    [model] dtype (the float32 master weights when it is "auto"). A PiSSA or OLoRA adapter is written as the plain
    LoRA of rank 2r it is on the original weights, with its init's A and B (`initial`; recomputed when None)."""
    family = vision_family(config.model.path)
    if method_unit(method).trains_base:
        dtype = None if config.model.dtype == "auto" else config.model.dtype
        if family is not None and "vision" in params:  # the whole vision-language model, its image side as read
            out = save_vision_language_model(run_dir / "model", config.model.path, cfg, params, family,
                                             family.read_config(config.model.path), dtype)
        else:
            out = save_model(run_dir / "model", cfg, params, dtype=dtype)
        copy_tokenizer(config.model.path, out)
        return out
    peft = method_unit(method).peft
    if peft is not None and peft.needs_initial(method) and initial is None:
        initial = initial_leaves(config.model.path, cfg, method, params)
    # PEFT's base_model_name_or_path: the Hub id, the bucket URL, or the local path
    base = hub_id_of(config.model.path) or (config.model.path if is_url(config.model.path)
                                            else str(Path(config.model.path)))
    return save_peft_adapter(run_dir / "adapter", params, cfg, method, base_model=base,
                             initial=initial, text_prefix=family.text_prefix if family is not None else "model.",
                             outside=None if family is None else family.outside_text,
                             image_side=None if family is None else (family, family.read_config(config.model.path)))


def write_run_result(run_dir: str | Path, out_dir: Path, step: int | None = None, log=None) -> Path:
    """What the run in `run_dir` writes at its end (adapter/, model/ or reward_model/), written into `out_dir` from
    its checkpoint of `step` (default: the latest) on this host's devices, whatever mesh it trained on."""
    run_dir = Path(run_dir)
    config = run_config_at(run_dir, step if step is not None else 1 << 62)
    output = config.train.output_dir
    checkpoints = Checkpoints(checkpoint_directory(output, run_dir),
                              keep=1, read_only=True)
    steps = checkpoints.steps()
    if not steps:
        raise JaxtuneError(f"{checkpoints.directory}: no checkpoint to export (the run saved none yet)")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise JaxtuneError(f"{checkpoints.directory}: no checkpoint for step {step} (have: {steps})")
    config = run_config_at(run_dir, step)
    model = config.model.path
    if log:
        log(f"{run_dir}: the checkpoint of step {step} on {model} ...")
    cfg = load_config(model)
    plan = train_plan(config, stored_dtype(model))
    plan = replace(plan, mesh=MeshConfig(), offload=OffloadConfig(moments_dtype=plan.offload.moments_dtype))
    run = abstract_run(cfg, plan, make_mesh(), config.train, total_steps=max(step, 1))
    trainable = checkpoints.restore_params(step, run.state["params"])
    initial: dict[str, dict] = {}
    with checked_reader(model, cfg) as reader:
        frozen = read_frozen(reader, run, model, initial)
    params = combine(trainable, frozen)
    objective = objective_named(config.train.objective)
    if objective.export is not None:
        return objective.export(out_dir, config, cfg, params)
    return export_result(out_dir, config, cfg, params, config.method, initial or None)


def export_run(run_dir: str | Path, target: str, out: str | Path, step: int | None = None, gguf_type: str = "f16",
               log=None) -> Path | str:
    """A run's result from its checkpoint of `step` (default: the latest; `run_dir` may also be a checkpoint,
    RUN/checkpoints/N) as `target`: "peft" (the adapter
    directory), "merged" (an HF model directory: the adapter merged, or a full fine-tune's or reward model's own),
    "gguf" (one GGUF file of `gguf_type`) or "gguf-lora" (llama.cpp's LoRA). Written to `out`; nothing is written
    into the run directory. A run may export while it trains (its checkpoints are only read). `run_dir` may be a
    run's URL `output_dir` and `out` a URL (`io.storage`)."""
    if target not in EXPORT_TARGETS:
        raise JaxtuneError(f"export target {target!r}: choose one of {', '.join(EXPORT_TARGETS)}")
    if is_url(out):  # written here, then copied there
        with tempfile.TemporaryDirectory(prefix="jaxtune-export-") as local:
            written = export_run(run_dir, target, Path(local) / out.rstrip("/").rsplit("/", 1)[-1], step, gguf_type,
                                 log)
            storage.upload(Path(written), out)
        return out
    run_dir, step = checkpoint_of(local_run_directory(run_dir), step)
    out = Path(out)
    if target.startswith("gguf"):
        if out.exists():
            raise JaxtuneError(f"{out}: already exists (choose a new file; nothing is overwritten)")
        check_output_dir(out.parent, "the GGUF file's directory")
    else:
        check_output_dir(out, f"--{target}")
    scratch = Path(tempfile.mkdtemp(prefix=".jaxtune-export-", dir=_nearest_dir(out.parent)))
    try:
        result = write_run_result(run_dir, scratch, step, log)
        config = run_config_at(run_dir, step if step is not None else 1 << 62)
        model, adapter = (result, None) if result.name != "adapter" else (config.model.path, result)
        objective = objective_named(config.train.objective)
        if objective.export is not None and target != "merged":
            raise JaxtuneError(f"{run_dir}: a {objective.name} run's result is {objective.result}: export it with "
                               "--merged")
        if target in ("peft", "gguf-lora") and adapter is None:
            raise JaxtuneError(f"{run_dir}: a {config.method.kind} fine-tune ({config.train.objective}) has no "
                               "adapter; export it with --merged or --gguf")
        if target == "peft" or (target == "merged" and adapter is None):
            return _move(result, out)
        if target == "merged":
            return export_merged(model, adapter, out, log=log)
        if target == "gguf":
            return export_gguf(model, adapter, out, gguf_type, log=log)
        assert adapter is not None  # gguf-lora of a run without one: refused above
        return export_gguf_lora(model, adapter, out, log=log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def checkpoint_of(path: str | Path, step: int | None) -> tuple[Path, int | None]:
    """(run directory, step) of a run directory and `step`, or of one of its checkpoints (RUN/checkpoints/N)."""
    path = Path(path)
    if path.parent.name == "checkpoints" and path.name.isdigit():
        if step is not None and step != int(path.name):
            raise JaxtuneError(f"{path} is the checkpoint of step {path.name}, not of --step {step}")
        return path.parent.parent, int(path.name)
    return path, step


def _nearest_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _move(source: Path, out: Path) -> Path:
    """`source`'s files into the directory `out` (created; files of the same names replaced)."""
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        os.replace(path, out / path.name)
    return out
