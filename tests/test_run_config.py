"""`RunConfig` is a typed dataclass written out by hand: these keep it in step with the objective registry."""

import dataclasses
import typing

from jaxtune.config import DataConfig, EvalConfig, MeshConfig, MethodConfig, ModelSection, OffloadConfig, TrainConfig
from jaxtune.objectives import OBJECTIVES
from jaxtune.run_config import SECTIONS, RunConfig, dump_run_config, load_run_config

RUN_SECTIONS = {"model": ModelSection, "method": MethodConfig, "data": DataConfig, "train": TrainConfig,
                "mesh": MeshConfig, "offload": OffloadConfig, "eval": EvalConfig}


def test_every_objective_section_is_a_typed_field_of_run_config():
    """An objective registered with a section fails here until RunConfig has a field of its name and type (and a
    field left behind by an objective that is gone, or lost its section, fails too)."""
    fields = typing.get_type_hints(RunConfig)
    objective_sections = {o.name: o.section for o in OBJECTIVES.values() if o.section is not None}
    assert fields == {**RUN_SECTIONS, **objective_sections}
    assert SECTIONS == fields and list(SECTIONS) == [f.name for f in dataclasses.fields(RunConfig)]


def test_every_section_defaults_and_reads_back():
    """Each field defaults to its section's defaults, and the TOML written of the defaults reads back equal."""
    config = RunConfig()
    for name, cls in SECTIONS.items():
        assert getattr(config, name) == cls()
    assert load_run_config(None) == config
    text = dump_run_config(config)
    assert [line[1:-1] for line in text.splitlines() if line.startswith("[")] == list(SECTIONS)
