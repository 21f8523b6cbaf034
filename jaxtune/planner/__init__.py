"""The memory planner: will this fine-tune fit, how should it be laid out, and how fast will it run.

    cfg = standard_config(7000)                                    # or model_from_directory(dir)[0]
    plan = TrainPlan(LoRAConfig(), batch_size=8, seq_len=2048, forward=ForwardOptions(remat="full"))
    est = estimate(cfg, plan, get_device("h100-80gb-8"))           # nothing is allocated; est.fits
    search(cfg, plan, get_device("v5e-8")).candidates[0]           # the fastest plan that fits (longest_context too)

`devices.py` the catalogue, `estimate.py`, `held.py`, `activations.py` the memory, `timing.py` the step time,
`search.py` the search, `confirm.py` XLA's figure (`compile_step`), `report.py` the table, `command.py` the CLI.
"""

from jaxtune.config.plan import TrainPlan as TrainPlan
from jaxtune.planner.confirm import CompiledMemory as CompiledMemory
from jaxtune.planner.confirm import compile_peak as compile_peak
from jaxtune.planner.confirm import compile_rollout as compile_rollout
from jaxtune.planner.confirm import compile_step as compile_step
from jaxtune.planner.devices import CATALOGUE as CATALOGUE
from jaxtune.planner.devices import Device as Device
from jaxtune.planner.devices import get_device as get_device
from jaxtune.planner.devices import known_targets as known_targets
from jaxtune.planner.estimate import Estimate as Estimate
from jaxtune.planner.estimate import estimate as estimate
from jaxtune.planner.report import format_estimate as format_estimate
from jaxtune.planner.report import format_longest_context as format_longest_context
from jaxtune.planner.report import format_search as format_search
from jaxtune.planner.report import plan_dict as plan_dict
from jaxtune.planner.search import LongestContext as LongestContext
from jaxtune.planner.search import SearchResult as SearchResult
from jaxtune.planner.search import longest_context as longest_context
from jaxtune.planner.search import search as search
from jaxtune.planner.shapes import model_from_directory as model_from_directory
from jaxtune.planner.shapes import standard_config as standard_config
from jaxtune.planner.timing import StepTime as StepTime
from jaxtune.planner.timing import step_time as step_time
