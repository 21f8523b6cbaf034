"""The run spine: one function from what fixes a run (a `TrainPlan`, its objective) to every array it holds and the
one jitted, donated, sharded step over them; the weights read straight into those arrays' shards. The trainer
(`jaxtune/train/`), the planner's estimate and `jaxtune plan --confirm` all read it.

    run.py     abstract_run: the abstract, sharded trees and the step;  train_plan: a run config's TrainPlan
    load.py    load_run: the checkpoint read into the run's shards, quantised or cast on the way
    shardings.py  param_shardings, optimizer_shardings, batch_sharding: every tree's, from `parallel/rules.py`
    state.py   the train state and its optimiser;  update.py: accumulation and the update every objective shares
"""

from jaxtune.spine.load import load_run as load_run
from jaxtune.spine.run import AbstractRun as AbstractRun
from jaxtune.spine.run import abstract_run as abstract_run
from jaxtune.spine.run import train_plan as train_plan
