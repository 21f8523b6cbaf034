"""The training objectives, one unit each (`base.py` says what a unit declares), registered here.

Adding an objective: a module beside these that builds an `Objective`, and its entry in OBJECTIVES. The trainer,
the spine, the planner and the TOML loader ([section], `train.objective`) all read this table (`objective_named`).
"""

from jaxtune.config.plan import TrainPlan
from jaxtune.errors import ConfigError
from jaxtune.objectives.base import Objective
from jaxtune.objectives.cpo import CPO, SIMPO
from jaxtune.objectives.distill import DISTILL
from jaxtune.objectives.dpo import DPO
from jaxtune.objectives.grpo import GRPO
from jaxtune.objectives.kto import KTO
from jaxtune.objectives.orpo import ORPO
from jaxtune.objectives.reward import REWARD
from jaxtune.objectives.rloo import RLOO
from jaxtune.objectives.sft import SFT

OBJECTIVES: dict[str, Objective] = {o.name: o for o in (SFT, DPO, REWARD, GRPO, RLOO, DISTILL, ORPO, CPO, SIMPO,
                                                            KTO)}
ALIASES = {"rlhf": "grpo"}  # the design card's name for online policy optimisation


def objective_named(name: str) -> Objective:
    """The registered objective `name` (or an alias), or a ConfigError listing them."""
    name = ALIASES.get(name, name)
    if name not in OBJECTIVES:
        raise ConfigError("objective", name, "choose one of " + ", ".join(OBJECTIVES))
    return OBJECTIVES[name]


def section_of(plan: TrainPlan):
    """The plan's objective section, or the objective's defaults when the plan holds none."""
    objective = objective_named(plan.objective)
    return plan.section if plan.section is not None or objective.section is None else objective.section()


def rows(plan: TrainPlan) -> int:
    """Rows of one micro-batch over all devices: `batch_size` examples times the objective's rows per example."""
    return plan.batch_size * objective_named(plan.objective).rows(section_of(plan))
