"""Run by tests/test_harness.py in a process of 8 CPU devices: the same tasks scored by JaxtuneLM on one device and
with its weights split over fsdp=4 x tensor=2; prints both models' per-request responses as JSON."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"

from jaxtune.harness import JaxtuneLM, evaluate_tasks  # noqa: E402

model, tasks = sys.argv[1], sys.argv[2:]
one = evaluate_tasks(JaxtuneLM(model=model), tasks, log_samples=True)
split_lm = JaxtuneLM(model=model, fsdp=4, tensor=2)
split = evaluate_tasks(split_lm, tasks, log_samples=True)
print(json.dumps({"devices": len(split_lm.params["layers"]["q_proj"]["kernel"].sharding.device_set),
                  **{task: [[s["resps"], t["resps"]] for s, t in zip(samples, split["samples"][task])]
                     for task, samples in one["samples"].items()}}))
