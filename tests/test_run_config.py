"""`RunConfig`'s sections: the run's own, typed fields written out by hand, and one per registered objective that
has a section, taken from the objective registry (an objective is one unit: its section needs no other file)."""

import dataclasses
import typing

import pytest

from jaxtune.config import DataConfig, EvalConfig, MeshConfig, MethodConfig, ModelSection, OffloadConfig, TrainConfig
from jaxtune.errors import JaxtuneError
from jaxtune.methods import LoRAConfig
from jaxtune.objectives import OBJECTIVES
from jaxtune.run_config import RUN_SECTIONS, RunConfig, dump_run_config, load_run_config, sections

RUN_OWN = {"model": ModelSection, "method": MethodConfig, "data": DataConfig, "train": TrainConfig,
           "mesh": MeshConfig, "offload": OffloadConfig, "eval": EvalConfig}


def test_the_sections_are_the_run_s_own_and_each_objective_s():
    """The run's own sections are RunConfig's typed fields; an objective registered with a section adds its own, in
    the registry's order, and one left behind by an objective that is gone (or lost its section) is refused."""
    fields = typing.get_type_hints(RunConfig)
    assert {k: v for k, v in fields.items() if k != "objectives"} == RUN_OWN == RUN_SECTIONS
    objective_sections = {o.name: o.section for o in OBJECTIVES.values() if o.section is not None}
    assert sections() == {**RUN_OWN, **objective_sections}
    assert [name for name, _ in RunConfig().objectives] == list(objective_sections)
    assert list(sections()) == [f.name for f in dataclasses.fields(RunConfig) if f.name != "objectives"] + list(
        objective_sections)
    with pytest.raises(JaxtuneError, match="'gone' is no registered objective with a section"):
        RunConfig(objectives=(("gone", None),))


def test_every_section_defaults_and_reads_back():
    """Each field defaults to its section's defaults, and the TOML written of the defaults reads back equal."""
    config = RunConfig()
    for name, cls in sections().items():
        section = config.section(name) if name not in RUN_OWN else getattr(config, name)
        assert section == (LoRAConfig() if cls is MethodConfig else cls())
    assert load_run_config(None) == config
    text = dump_run_config(config)
    assert [line[1:-1] for line in text.splitlines() if line.startswith("[")] == list(sections())


def test_strings_with_control_characters_read_back(tmp_path):
    """A stop string may hold a newline, a tab, quotes or a backslash: the TOML written of it reads back equal."""
    config = load_run_config(None, ['grpo.stop_strings=["\\n\\n", "</a>", "say \\"hi\\"\\t\\\\"]'])
    assert config.section("grpo").stop_strings == ("\n\n", "</a>", 'say "hi"\t\\')
    (tmp_path / "back.toml").write_text(dump_run_config(config))
    assert load_run_config(tmp_path / "back.toml") == config
