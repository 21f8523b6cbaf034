"""One process of a multi-process load, run by tests/test_distributed.py:

    python tests/load_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID MODEL_DIR

joins the cluster (`jax.distributed`, gloo on CPU), reads MODEL_DIR into a LoRA run on an fsdp mesh of every
process's device (`spine.load.load_run`) and prints {"bytes_read", "checkpoint_bytes", "params_sum"}: the tensor
bytes this process read, the checkpoint's, and a checksum of the frozen weights gathered from all processes.
"""

import json
import sys
from pathlib import Path

import jax
import numpy as np

from jaxtune.config import ForwardOptions, MeshConfig
from jaxtune.config.plan import TrainPlan
from jaxtune.io.safetensors import CheckpointReader
from jaxtune.methods import method_config
from jaxtune.models.hf_config import load_config
from jaxtune.parallel.distributed import ClusterConfig, host_copy, join_cluster
from jaxtune.parallel.mesh import make_mesh
from jaxtune.spine.load import load_run
from jaxtune.spine.run import abstract_run

coordinator, processes, process_id, model_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
join_cluster(ClusterConfig(coordinator, processes, process_id))
cfg = load_config(model_dir)
plan = TrainPlan(method_config("lora", rank=4), processes, 32, 1, param_dtype="float32",
                 forward=ForwardOptions(compute_dtype="float32", remat="none"), mesh=MeshConfig())
run = abstract_run(cfg, plan, make_mesh(MeshConfig()))
state, frozen, _ = load_run(run, model_dir, 0)
checksum = float(sum(np.abs(x).sum() for x in jax.tree.leaves(host_copy(frozen))))
size = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
print(json.dumps({"bytes_read": CheckpointReader.total_bytes_read, "checkpoint_bytes": size, "params_sum": checksum}))
