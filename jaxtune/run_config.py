"""Reading and writing a training run's TOML: `RunConfig`, one frozen dataclass with a field per section.

    [model] [method] [data] [train] [mesh] [offload] [eval]   the run's own (`jaxtune.config`; [method]: its kind's)
    [dpo] [grpo] [distill] ...                          each registered objective's own section, if it has one
    config = load_run_config("run.toml", ["train.learning_rate=1e-4"])   # `--set` items: TOML values, or bare text
    text = dump_run_config(config)                                       # TOML that reads back to an equal config

The section dataclasses validate their own values; this module reads TOML into them, names where a bad value came
from (the file, or the `--set` item), and refuses an unknown section or key, naming the known ones.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxtune.config import DataConfig, EvalConfig, MeshConfig, MethodConfig, ModelSection, OffloadConfig, TrainConfig
from jaxtune.config.forward import ForwardOptions, Remat
from jaxtune.config.plan import FORWARD_KNOBS
from jaxtune.config.run import context_split_error
from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.hub import local_dataset, local_model
from jaxtune.methods import METHODS, LoRAConfig, method_unit, option_names
from jaxtune.models.kernels import check_choice as check_kernel
from jaxtune.objectives import OBJECTIVES, objective_named


@dataclass(frozen=True)
class RunConfig:
    """A training run: a field per TOML section of the run's own, every one defaulted, and `objectives`: the section
    of each registered objective that has one ([dpo], [grpo], ...), by name, in the registry's order (each
    objective's defaults unless the TOML gives keys). `section(name)` reads one."""

    model: ModelSection = field(default_factory=ModelSection)
    method: MethodConfig = field(default_factory=LoRAConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    objectives: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        given = dict(self.objectives)
        sections = objective_sections()
        unknown = sorted(set(given) - set(sections))
        if unknown:
            raise JaxtuneError(f"RunConfig objectives: {unknown[0]!r} is no registered objective with a section "
                               f"(those with one: {', '.join(sections)})")
        object.__setattr__(self, "objectives", tuple((name, given.get(name) or cls()) for name, cls in
                                                     sections.items()))

    def section(self, objective: str):
        """The section of objective `objective` (None: it has none)."""
        return dict(self.objectives).get(objective)


RUN_SECTIONS: dict[str, type] = {name: hint for name, hint in typing.get_type_hints(RunConfig).items()
                                 if name != "objectives"}


def objective_sections() -> dict[str, type]:
    """{objective name: its section's dataclass} of the registered objectives that have a section, in order."""
    return {o.name: o.section for o in OBJECTIVES.values() if o.section is not None}


def sections() -> dict[str, type]:
    """Every TOML section a run config may hold, in the order `dump_run_config` writes them (the method's options
    class depends on its kind: `MethodConfig` stands for it)."""
    return {**RUN_SECTIONS, **objective_sections()}


def _parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # an unquoted string


TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", tuple: "a list"}
PATTERN_KEYS = ("rank_pattern", "alpha_pattern", "columns", "environment_options")  # TOML tables: {"regex" = value,
# ...}, {ours = theirs}, {option = value}
REGEX_KEYS = ("target_modules", "exclude_modules")  # a string is a regular expression (PEFT's string form)


def _value(section: str, key: str, value, expected: type):
    """`value` as the field's type, or a ConfigError naming section.key and the type it needs."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is tuple and key in PATTERN_KEYS and isinstance(value, dict):
        return value
    if expected is tuple and key in REGEX_KEYS and isinstance(value, str):
        return value
    if expected is tuple and isinstance(value, (list, str)):
        return tuple([value] if isinstance(value, str) else value)
    if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
        raise ConfigError(f"{section}.{key}", value, f"must be {TYPE_NAMES.get(expected, expected.__name__)}")
    return value


def _located(error: ConfigError, source: str) -> JaxtuneError:
    """One line: `run.toml: train.learning_rate = -0.001: must be > 0`, or for an override that names the field
    itself, `--set train.learning_rate=-0.001: must be > 0`."""
    if source.startswith("--set") and "[" not in error.field:
        return JaxtuneError(f"{source}: {error.valid}")
    return JaxtuneError(f"{source}: {error}")


def _build(raw: dict, where: str, overridden: dict[tuple[str, str], str]) -> RunConfig:
    """`overridden`: (section, key) -> the `--set` item that gave it, named in its errors instead of the file."""
    known_sections = sections()
    parts: dict[str, Any] = {}  # section name -> its dataclass
    for name, values in raw.items():
        if name not in known_sections:
            raise JaxtuneError(f"{where}: unknown section [{name}] (sections: {', '.join(known_sections)})")
        if not isinstance(values, dict):
            raise JaxtuneError(f"{where}: [{name}] must be a table")
        source = lambda key: f"--set {overridden[name, key]}" if (name, key) in overridden else where
        if name == "method":  # the kind names the unit whose options the other keys are
            kind = values.pop("kind", "lora")
            try:
                cls = method_unit(_value(name, "kind", kind, str)).options
            except ConfigError as e:
                raise _located(e.in_section(name), source("kind")) from None
        else:
            cls = known_sections[name]
        defaults = _flat(cls())
        for key, value in values.items():
            if key not in defaults:
                raise JaxtuneError(f"{source(key)}: {_unknown(name, key, cls)}")
            try:
                values[key] = _value(name, key, value, type(defaults[key]))
            except ConfigError as e:
                raise _located(e, source(key)) from None
        try:
            if name == "model":  # the forward's knobs are keys of [model]
                forward = {k: values.pop(k) for k in list(values) if k in FORWARD_KNOBS}
                values["forward"] = ForwardOptions(**{**_flat(ModelSection().forward), **forward})
                check_kernel(values["forward"].attention)
            parts[name] = cls(**values)
            if name == "train":
                objective_named(parts[name].objective)
        except ConfigError as e:
            raise _located(e.in_section(name), source(e.field.split("[")[0])) from None
    config = RunConfig(**{k: v for k, v in parts.items() if k in RUN_SECTIONS},
                       objectives=tuple((k, v) for k, v in parts.items() if k not in RUN_SECTIONS))
    why = context_split_error(config.data.max_seq_len, config.mesh.context)
    if why:
        raise JaxtuneError(f"{where}: [data] max_seq_len = {config.data.max_seq_len} {why}")
    if config.offload.moments_dtype != "float32" and config.train.optimizer != "adamw":
        raise JaxtuneError(f"{where}: [offload] moments_dtype = {config.offload.moments_dtype!r} is for [train] "
                           f"optimizer = 'adamw', not {config.train.optimizer!r}")
    objective = objective_named(config.train.objective)
    rollout = objective.rollout_tokens(config.section(objective.name)) if objective.section else 0
    if (objective.generates or rollout) and config.mesh.context > 1:
        raise JaxtuneError(f"{where}: [train] objective = {config.train.objective!r} with [mesh] context = "
                           f"{config.mesh.context}: its rollouts decode whole rows, which a context axis would split; "
                           "use a mesh without one")
    if rollout >= config.data.max_seq_len:
        raise JaxtuneError(f"{where}: [{objective.name}] max_new_tokens = {rollout} leaves no room for a prompt in "
                           f"[data] max_seq_len = {config.data.max_seq_len}; use at most {config.data.max_seq_len - 1}")
    return config


def _flat(section) -> dict[str, object]:
    """A section's TOML keys and values: its fields, a `ForwardOptions` field's knobs in its place (remat as its
    policy's name)."""
    items: dict[str, object] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, ForwardOptions):
            items.update(_flat(value))
        else:
            items[f.name] = value.policy if isinstance(value, Remat) else value
    return items


def _unknown(section: str, key: str, cls: type) -> str:
    """Why `key` is not a key of [section] (read into `cls`), naming the known ones, and for [method] the kinds
    that read it."""
    known = ", ".join(_flat(cls()))
    if section != "method":
        return f"unknown key {key!r} in section [{section}] (known: {known})"
    kind = cls.kind  # type: ignore[attr-defined]
    readers = [k for k in METHODS if key in option_names(k)]
    whose = f"; it is an option of {', '.join(readers)}" if readers else ""
    return f"unknown key {key!r} in section [method] for kind {kind!r} (known: kind, {known or 'nothing else'}){whose}"


def with_local_models(config: RunConfig) -> RunConfig:
    """`config` with [model] path and its objective's model fields (a DPO reference, a distillation teacher:
    `Objective.model_fields`) as local paths: a Hub id resolved through the Hugging Face cache (`jaxtune.hub`)."""
    model = dataclasses.replace(config.model, path=local_model(config.model.path) if config.model.path else "")
    objective = objective_named(config.train.objective)
    section = config.section(objective.name)
    named = {f: local_model(getattr(section, f)) for f in objective.model_fields if getattr(section, f)}
    objectives = tuple((name, dataclasses.replace(s, **named) if name == objective.name and named else s)
                       for name, s in config.objectives)
    return dataclasses.replace(config, model=model, objectives=objectives)


def with_local_inputs(config: RunConfig) -> RunConfig:
    """`with_local_models`, and [data] train / eval as local paths too (a Hub dataset id: its Parquet split; eval
    without a split: the repo's validation, else test split)."""
    data = dataclasses.replace(config.data, train=config.data.train and local_dataset(config.data.train, ("train",)),
                               eval=config.data.eval and local_dataset(config.data.eval, ("validation", "test")))
    return dataclasses.replace(with_local_models(config), data=data)


def load_run_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a TOML run config (or start from defaults when `path` is None) and apply "section.key=value" overrides."""
    raw: dict = {}
    where = "config"
    if path is not None:
        path = Path(path)
        where = str(path)
        if not path.is_file():
            raise JaxtuneError(f"{path}: config file not found")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise JaxtuneError(f"{path}: invalid TOML: {e}") from None
    overridden = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot:
            raise JaxtuneError(f"--set {item!r}: expected section.key=value")
        raw.setdefault(section, {})[name] = _parse_value(value.strip())
        overridden[section, name] = item
    return _build(raw, where, overridden)


def _toml_value(value) -> str:
    if isinstance(value, tuple) and value and all(isinstance(v, tuple) and len(v) == 2 for v in value):
        return "{" + ", ".join(f"{_toml_value(k)} = {_toml_value(v)}" for k, v in value) + "}"  # a pattern table
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):  # JSON's escapes are TOML's (a stop string may hold a newline)
        return json.dumps(value, ensure_ascii=False)
    return repr(value)


def _sections_of(config: RunConfig) -> dict[str, Any]:
    """{TOML section name: its dataclass} of `config`, in the order `sections()` gives."""
    return {**{name: getattr(config, name) for name in RUN_SECTIONS}, **dict(config.objectives)}


def config_items(config: RunConfig) -> dict[str, object]:
    """The config flattened to "section.key" -> a JSON value (tuples as lists), as checkpoints record it."""
    items = {f"{name}.{key}": value for name, section in _sections_of(config).items()
             for key, value in _flat(section).items()}
    return json.loads(json.dumps({"method.kind": config.method.kind, **items}))


def dump_run_config(config: RunConfig) -> str:
    """The config as TOML text that `load_run_config` reads back to an equal config."""
    lines = []
    for name, section in _sections_of(config).items():
        lines.append(f"[{name}]")
        if name == "method":
            lines.append(f"kind = {_toml_value(section.kind)}")
        lines += [f"{key} = {_toml_value(value)}" for key, value in _flat(section).items()]
        lines.append("")
    return "\n".join(lines)
