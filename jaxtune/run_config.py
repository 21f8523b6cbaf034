"""Reading and writing a training run's TOML: `RunConfig`, the tree of its sections, with dotted overrides.

    [model] [method] [data] [train] [mesh] [offload]   the sections of `jaxtune.config` (run.py, method.py)
    [dpo] [grpo] [distill] ...                          each registered objective's own section, if it has one

The section dataclasses validate their own values; this module only reads TOML into them, names where a bad
value came from (the file, or the `--set` item), and writes a resolved config back. Only the section of the
chosen objective is read; the others keep their defaults (and are written out as such).

Every key must be a field: an unknown key is an error naming it and its section. `--set train.lr=1e-4`-style
overrides are parsed as TOML values (strings may go unquoted). The resolved config is written back as TOML.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import field
from pathlib import Path

from jaxtune.config import DataConfig, MeshConfig, MethodConfig, ModelSection, OffloadConfig, TrainConfig
from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.objectives import OBJECTIVES, objective_named

SECTIONS = {"model": ModelSection, "method": MethodConfig, "data": DataConfig, "train": TrainConfig,
            "mesh": MeshConfig, "offload": OffloadConfig,
            **{o.name: o.section for o in OBJECTIVES.values() if o.section is not None}}
RunConfig = dataclasses.make_dataclass(
    "RunConfig", [(name, cls, field(default_factory=cls)) for name, cls in SECTIONS.items()], frozen=True)
RunConfig.__doc__ = "A training run: one frozen dataclass a TOML section (SECTIONS), every field defaulted."
RunConfig.__module__ = __name__


def _parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # an unquoted string


TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", tuple: "a list"}
PATTERN_KEYS = ("rank_pattern", "alpha_pattern", "columns")  # TOML tables: {"regex" = value, ...}, {ours = theirs}
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
    sections = {}
    for name, values in raw.items():
        if name not in SECTIONS:
            raise JaxtuneError(f"{where}: unknown section [{name}] (sections: {', '.join(SECTIONS)})")
        if not isinstance(values, dict):
            raise JaxtuneError(f"{where}: [{name}] must be a table")
        cls = SECTIONS[name]
        known = {f.name: f for f in dataclasses.fields(cls)}
        source = lambda key: f"--set {overridden[name, key]}" if (name, key) in overridden else where
        for key, value in values.items():
            if key not in known:
                raise JaxtuneError(f"{source(key)}: unknown key {key!r} in section [{name}] "
                                   f"(known: {', '.join(known)})")
            try:
                values[key] = _value(name, key, value, type(getattr(cls(), key)))
            except ConfigError as e:
                raise _located(e, source(key)) from None
        try:
            sections[name] = cls(**values)
            if name == "train":
                objective_named(sections[name].objective)
        except ConfigError as e:
            raise _located(e.in_section(name), source(e.field.split("[")[0])) from None
    return RunConfig(**sections)


def load_run_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
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
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def config_items(config: RunConfig) -> dict[str, object]:
    """The config flattened to "section.key" -> a JSON value (tuples as lists), as checkpoints record it."""
    return json.loads(json.dumps({f"{name}.{f.name}": getattr(getattr(config, name), f.name)
                                  for name in SECTIONS for f in dataclasses.fields(getattr(config, name))}))


def dump_run_config(config: RunConfig) -> str:
    """The config as TOML text that `load_run_config` reads back to an equal config."""
    lines = []
    for name in SECTIONS:
        lines.append(f"[{name}]")
        section = getattr(config, name)
        lines += [f"{f.name} = {_toml_value(getattr(section, f.name))}" for f in dataclasses.fields(section)]
        lines.append("")
    return "\n".join(lines)
