"""Weights read straight into the run's shards and formats: `load_run(run, model_dir, seed, second)`.

Every leaf of an abstract run that comes from the checkpoint is created shard by shard (`read_tree`, `_make_array`):
each device's shard is read from the files (safetensors: positioned reads of just that slice, `io/safetensors.py`)
and cast on the way, so no whole copy of the model exists anywhere and each process reads only its devices' slices.
A QLoRA kernel is quantised a few rows at a time as it is read (`models/quant.quantize_by_rows`, bit for bit the
whole matrix's quantisation); a method's init from the weights (`Method.base_init`: LoRA's PiSSA, OLoRA, LoftQ)
changes each kernel it adapts a layer at a time as it is read. The leaves a method or an objective adds (LoRA, a
reward head) are made by one jit straight into their shardings; a second model (a reference, a teacher) is read the
same way."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxtune.config import MethodConfig, ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.host_memory import release_freed_memory
from jaxtune.io.gguf import forget_readers
from jaxtune.methods.base import BaseInit, method_unit
from jaxtune.methods.transform import add_method_leaves, combine, partition
from jaxtune.methods.vision import add_vision_leaves, vision_mask
from jaxtune.models.hf_weights import checked_reader, expert_rows, read_layer
from jaxtune.models.params import ParamSpec, param_specs
from jaxtune.models.quant import BitPattern, NF4Array, QuantizedArray, from_bit_patterns, full_shape, quantize_by_rows
from jaxtune.spine.run import AbstractRun


def _is_stored(x) -> bool:
    return isinstance(x, QuantizedArray | BitPattern)


def _keys(path) -> tuple[str, ...]:
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def checkpoint_paths(cfg: ModelConfig) -> set[tuple[str, ...]]:
    """Dict paths of the leaves a checkpoint of `cfg` holds (a tied model's parted head reads the embedding)."""
    flat = jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=lambda x: isinstance(x, ParamSpec))[0]
    return {_keys(path) for path, _ in flat} | {("lm_head", "kernel")}


def _read(reader, keys: tuple[str, ...], row: int | None, index: tuple[slice, ...], cfg: ModelConfig) -> np.ndarray:
    """Row `row` of stacked leaf `keys` (None: an unstacked leaf), sliced by `index`, in our layout."""
    if keys == ("lm_head", "kernel") and cfg.tie_word_embeddings:
        return read_layer(reader, ("embed_tokens",), None, index[::-1], cfg).T  # a head parted from a tied embedding
    return read_layer(reader, keys, None if row is None else cfg.module_layers(keys[1])[row], index, cfg)


def _float_leaf(reader, keys: tuple[str, ...], leaf: jax.ShapeDtypeStruct | BitPattern, cfg: ModelConfig):
    """A float leaf, or a BitPattern's bits (the values cast to its dtype, viewed as uint16), read shard by shard."""
    stacked = keys[0] == "layers"
    bits = isinstance(leaf, BitPattern)
    dtype, target = np.dtype(leaf.dtype), leaf.bits if isinstance(leaf, BitPattern) else leaf

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        if not stacked:
            out = _read(reader, keys, None, index, cfg).astype(dtype)
        else:
            layers = range(*index[0].indices(target.shape[0]))
            out = np.empty((len(layers), *[len(range(*s.indices(n))) for s, n in zip(index[1:], target.shape[1:])]),
                           dtype)
            for j, i in enumerate(layers):
                out[j] = _read(reader, keys, i, index[1:], cfg)
        return out.view(np.uint16) if bits else out

    array = _make_array(target.shape, target.sharding, shard)
    return BitPattern(array, leaf.dtype) if bits else array


def _make_array(shape: tuple[int, ...], sharding, read_shard) -> jax.Array:
    """`jax.make_array_from_callback`, holding one shard in host memory at a time (it calls the callback for every
    device before placing any: a whole leaf at once on a one-host mesh). Each distinct shard is read once and put on
    every device that holds it."""
    indices = sharding.addressable_devices_indices_map(shape)
    devices_of: dict[tuple, list] = {}
    index_of = {}
    for device, index in indices.items():
        key = tuple(s.indices(n) for s, n in zip(index, shape))
        devices_of.setdefault(key, []).append(device)
        index_of[key] = index
    placed = {}
    for key, devices in devices_of.items():
        data = read_shard(index_of[key])
        placed.update({d: jax.device_put(data, SingleDeviceSharding(d, memory_kind=sharding.memory_kind))
                       for d in devices})
    return jax.make_array_from_single_device_arrays(shape, sharding, [placed[d] for d in indices])


def _quantized_leaf(reader, keys: tuple[str, ...], leaf: QuantizedArray, cfg: ModelConfig) -> QuantizedArray:
    """A QLoRA kernel quantised a few rows at a time from the float checkpoint, then placed in its children's
    shardings."""
    children, treedef = jax.tree.flatten(leaf)
    host = [np.empty(c.shape, np.dtype(c.dtype)) for c in children]
    bits = 4 if isinstance(leaf, NF4Array) else 8
    double_quant = isinstance(leaf, NF4Array) and leaf.absmax2 is not None
    experts = keys[:2] == ("layers", "experts")
    size = (cfg.expert_size if keys[2] == "gate_up_proj" else cfg.hidden_size) if experts else 0
    L, d_in, d_out = full_shape(leaf)[0], *full_shape(leaf)[-2:]
    for i in range(L):
        for e in range(cfg.num_experts) if experts else [None]:
            def rows(a, b, i=i, e=e):  # torch's layout [out, in]
                if experts:  # row i of the stack: the mixture's i-th layer
                    return expert_rows(reader, keys[2], cfg.module_layers("experts")[i], e, slice(a, b), slice(None),
                                       size)
                return _read(reader, keys, i, (slice(None), slice(a, b)), cfg).T
            q = quantize_by_rows(rows, (d_in, d_out), leaf.dtype, bits, double_quant)
            at = (i,) if e is None else (i, e)
            for h, c in zip(host, jax.tree.leaves(q)):
                h[at] = c
    placed = [_make_array(c.shape, c.sharding, lambda index, h=h: h[index]) for c, h in zip(children, host)]
    del host
    _return_freed_host_memory()
    return jax.tree.unflatten(treedef, placed)


def _initialised_leaf(reader, keys: tuple[str, ...], leaf, cfg: ModelConfig, method: MethodConfig,
                      base_init: BaseInit) -> tuple:
    """(kernel, {leaf: [L, ...] host float32}): a kernel the method's init changes (`BaseInit.layers`: LoRA's PiSSA,
    OLoRA, LoftQ) read and initialised one layer at a time, the kernel placed in its sharding (as stored: float,
    BitPattern or quantised)."""
    quantized, bits = isinstance(leaf, QuantizedArray), isinstance(leaf, BitPattern)
    dtype = np.dtype(leaf.dtype)
    L = full_shape(leaf.bits if bits else leaf)[0]
    children, treedef = jax.tree.flatten(leaf) if quantized else ([], None)
    host: list | np.ndarray = [np.empty(c.shape, np.dtype(c.dtype)) for c in children]
    leaves: dict[str, np.ndarray] = {}
    read_layer = lambda i: _read(reader, keys, i, (slice(None), slice(None)), cfg).astype(dtype)  # noqa: E731
    for i, (base, new) in enumerate(base_init.layers(method, cfg, keys[1], read_layer)):
        if quantized:
            for h, c in zip(host, jax.tree.leaves(base)):
                h[i] = c
        else:
            if i == 0:
                host = np.empty((L, *base.shape), dtype)
            host[i] = base
        for name, value in new.items():
            leaves.setdefault(name, np.empty((L, *value.shape), np.float32))[i] = value
    if quantized:
        placed = [_make_array(c.shape, c.sharding, lambda index, h=h: h[index]) for c, h in zip(children, host)]
        kernel = jax.tree.unflatten(treedef, placed)
    else:
        assert isinstance(host, np.ndarray)  # filled by the layers above
        target = leaf.bits if bits else leaf
        values = host.view(np.uint16) if bits else host
        kernel = _make_array(target.shape, target.sharding, lambda index: values[index])
        kernel = BitPattern(kernel, leaf.dtype) if bits else kernel
    del host
    _return_freed_host_memory()
    return kernel, leaves


def read_tree(reader, abstract: dict, cfg: ModelConfig, method: MethodConfig | None = None,
              initial: dict | None = None) -> dict:
    """The leaves of `abstract` (ShapeDtypeStructs with shardings, quantised leaves whole) that a checkpoint of
    `cfg` holds, read into their shardings; None where a leaf does not come from the checkpoint.

    method: where its init changes the base (`Method.base_init`: LoRA's PiSSA, OLoRA, LoftQ), those kernels are read
    initialised, and the init's leaves (host arrays) put in `initial` (a dict) by module name."""
    paths = checkpoint_paths(cfg)
    base_init = None if method is None else method_unit(method).base_init
    changed = () if base_init is None else base_init.modules(method, cfg)

    def read(path, leaf):
        keys = _keys(path)
        if keys not in paths:
            return None
        if isinstance(leaf, QuantizedArray) and leaf.codes is None:  # the trainable half of a frozen kernel
            return leaf
        if keys[0] == "layers" and keys[1] in changed and keys[2:] == ("kernel",):
            kernel, leaves = _initialised_leaf(reader, keys, leaf, cfg, method, base_init)
            if initial is not None:
                initial[keys[1]] = leaves
            return kernel
        if isinstance(leaf, QuantizedArray):
            return _quantized_leaf(reader, keys, leaf, cfg)
        return _float_leaf(reader, keys, leaf, cfg)

    return jax.tree_util.tree_map_with_path(read, abstract, is_leaf=_is_stored)


def initial_leaves(model: str | Path, cfg: ModelConfig, method: MethodConfig, params: dict) -> dict:
    """{module: {leaf: [L, ...] float32}} of `method`'s init from the base weights (`Method.base_init`: PiSSA, OLoRA),
    recomputed a layer at a time from the original weights in `model`, each kernel cast to its dtype in `params` (as
    in training): what `PeftFormat.as_stored` converts a trained adapter with."""
    base_init = method_unit(method).base_init
    initial: dict[str, dict] = {}
    if base_init is None:
        return initial
    with checked_reader(model, cfg) as reader:
        for name in base_init.modules(method, cfg):
            dtype = np.dtype(params["layers"][name]["kernel"].dtype)
            keys = ("layers", name, "kernel")

            def read_layer(i: int, keys: tuple[str, ...] = keys, dtype: np.dtype = dtype) -> np.ndarray:
                return _read(reader, keys, i, (slice(None),) * 2, cfg).astype(dtype)

            layers = [new for _, new in base_init.layers(method, cfg, name, read_layer)]
            initial[name] = {leaf: np.stack([layer[leaf] for layer in layers]) for leaf in layers[0]}
    return initial


def _new_leaves(run: AbstractRun, loaded: dict, seed: int) -> dict:
    """The trainable leaves no checkpoint holds (a method's, an objective's head), made in their shardings."""
    cfg, method, objective = run.cfg, run.plan.method, run.objective
    paths = checkpoint_paths(cfg)
    text = _text(run.state["params"])
    is_new = jax.tree_util.tree_map_with_path(lambda p, _: _keys(p) not in paths, text)
    if not any(jax.tree.leaves(is_new)):
        return jax.tree.map(lambda _: None, text)
    shardings = jax.tree.map(lambda leaf, new: leaf.sharding if new else None, text, is_new)

    def make(base):
        params = add_method_leaves(from_bit_patterns(base), cfg, method, jax.random.key(seed))
        if objective.head:
            params = objective.head(params, cfg, jax.random.key(seed + 1))
        return jax.tree.map(lambda x, new: x if new else None, params_like(params, text), is_new)

    return jax.jit(make, out_shardings=shardings)(loaded)


def _text(tree: dict) -> dict:
    """A tree less its image side (read apart: `read_image_side`)."""
    return {k: v for k, v in tree.items() if k != "vision"}


def params_like(params: dict, template: dict) -> dict:
    """`params` restricted to the dict paths of `template` (a trainable tree with None where frozen)."""
    if template is None:  # a frozen subtree (a vision-language run's image side)
        return None
    if not isinstance(template, dict):
        return template if isinstance(template, QuantizedArray) else params
    return {k: params_like(params[k], v) for k, v in template.items()}


def read_frozen(reader, run: AbstractRun, model: str | Path, initial: dict | None = None) -> dict:
    """The run's frozen weights (`read_tree`), a vision-language run's image side read whole (it is small) and
    replicated as `frozen["vision"]`."""
    frozen = read_tree(reader, {k: v for k, v in run.frozen.items() if k != "vision"}, run.cfg, run.plan.method,
                       initial)
    if "vision" in run.frozen:
        frozen["vision"] = read_image_side(run, model, 0)[1]
    return frozen


def read_image_side(run: AbstractRun, model: str | Path, seed: int) -> tuple[dict | None, dict]:
    """(trained, frozen) halves of a vision-language run's image side (`spine.run`'s), read whole (it is small)
    with the method's leaves added (`methods.vision`; LoRA's A drawn from `seed`), each in its sharding; the
    trained half float32 (None when the method trains none of it)."""
    images, method = run.plan.images, run.plan.method
    vision = images.family.read_params(model, images.config, jax.numpy.dtype(run.plan.param_dtype))
    vision = add_vision_leaves(vision, method, images.family, jax.random.fold_in(jax.random.key(seed), 1))
    trained, frozen = partition(vision, vision_mask(vision, method, images.family))
    frozen = jax.device_put(frozen, jax.tree.map(lambda x: x.sharding, run.frozen["vision"]))
    abstract = run.state["params"].get("vision")
    if abstract is None:
        return None, frozen
    return jax.device_put(jax.tree.map(lambda x: x.astype(np.float32), trained),
                          jax.tree.map(lambda x: x.sharding, abstract)), frozen


def load_run(run: AbstractRun, model: str | Path, seed: int, second: str | Path | None = None
             ) -> tuple[dict, dict, dict | None]:
    """(state, frozen, second model) of `run` from the checkpoint in `model`, each array created in its sharding.

    seed: of the new leaves (LoRA's A as `apply_method(base, cfg, method, key(seed))` draws it; a head from
    seed + 1) and of the state's RNG. second: the objective's second model, "base" or a model directory (None when
    the run has none).
    """
    if (second is None) != (run.second is None):
        raise JaxtuneError(f"objective {run.objective.name}: second model {second!r} does not match the run's")
    initial: dict[str, dict] = {}  # a LoRA init's A and B, read with the kernels it changes
    with checked_reader(model, run.cfg) as reader:
        frozen = read_frozen(reader, run, model, initial)
        trainable = read_tree(reader, _text(run.state["params"]), run.cfg)
        second_params = read_tree(reader, run.second, run.cfg) if second == "base" and run.second is not None else None
    if second is not None and second != "base" and run.second is not None:
        assert run.context.second_cfg is not None  # a run with a second model has its architecture
        with checked_reader(second, run.context.second_cfg) as reader:
            second_params = read_tree(reader, run.second, run.context.second_cfg)
    new = _new_leaves(run, combine(trainable, _text(frozen)), seed)
    trainable = jax.tree.map(lambda a, b: b if a is None else a, trainable, new, is_leaf=lambda x: x is None)
    if "vision" in run.state["params"]:
        trainable["vision"] = read_image_side(run, model, seed)[0]
    for name, leaves in initial.items():
        abstract = run.state["params"]["layers"][name]
        placed = {k: _make_array(v.shape, abstract[k].sharding, lambda index, v=v: v[index]) for k, v in leaves.items()}
        trainable["layers"][name] = {**trainable["layers"][name], **placed}
    state = run.init_state(trainable, seed, donate=True)
    forget_readers()  # a GGUF file's parsed metadata would stay resident for the whole run
    _return_freed_host_memory()
    return state, frozen, second_params


def _return_freed_host_memory() -> None:
    """Hand the reads' freed buffers back to the OS: glibc keeps freed heap pages mapped (about 50 MiB of a 1.1 GiB
    QLoRA load stayed resident without this; benchmarks/load_memory.py). A no-op off glibc."""
    jax.effects_barrier()
    release_freed_memory()
