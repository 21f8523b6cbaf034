"""Setups that run but waste the run, said once at start as `JaxtuneWarning`s (`warn_degenerate`; the sentences:
`degenerate_setup`):

- padding: more than half of the token slots a step computes hold no token (short examples in long rows, or fewer
  rows of data than a step takes) — pack, lower `data.max_seq_len` or `train.batch_size`;
- a dataset that fills less than one step: each step trains the same rows and empty ones;
- `train.warmup_steps` reaching the run's last step: the learning rate never gets to `train.learning_rate`;
- `train.eval_every` / `train.checkpoint_every` beyond the run's steps: they never happen before the end;
- `train.profile_steps` starting after the last step: no trace.
"""

from __future__ import annotations

import warnings

from jaxtune.errors import JaxtuneWarning


def degenerate_setup(config, task) -> list[str]:
    """What is degenerate about `config` as `task` (`train.start.StartedRun`) will run it, one sentence each."""
    tc, data = config.train, task.training
    total = task.total_steps
    said = []
    rows_per_step = tc.grad_accum * tc.batch_size
    if data.rows_per_epoch is not None and data.rows_per_epoch < rows_per_step:
        said.append(f"data.train gives {data.rows_per_epoch} rows of {config.data.max_seq_len} tokens, fewer than one "
                    f"step takes (train.batch_size {tc.batch_size} x train.grad_accum {tc.grad_accum}): every step "
                    f"trains on those and {rows_per_step - data.rows_per_epoch} empty rows; lower train.batch_size "
                    "or train.grad_accum")
    if data.tokens_per_epoch is not None:
        slots = task.steps_per_epoch * rows_per_step * config.data.max_seq_len
        padding = 1 - data.tokens_per_epoch / slots
        if padding > 0.5:
            fix = "lower data.max_seq_len" if config.data.pack else "set data.pack = true or lower data.max_seq_len"
            said.append(f"{padding:.0%} of the tokens each step computes are padding ({data.tokens_per_epoch:,} tokens "
                        f"an epoch in {task.steps_per_epoch} steps of {rows_per_step} x {config.data.max_seq_len}); "
                        f"{fix}")
    if tc.warmup_steps >= total:
        said.append(f"train.warmup_steps = {tc.warmup_steps} reaches the run's last step ({total}): the learning rate "
                    f"never rises to train.learning_rate = {tc.learning_rate:g}")
    for name in ("eval_every", "checkpoint_every"):
        every = getattr(tc, name)
        if every > total:
            said.append(f"train.{name} = {every} is beyond the run's {total} steps: it happens only at the end")
    if tc.profile_steps and tc.profile_steps[0] > total:
        said.append(f"train.profile_steps = {list(tc.profile_steps)} starts after the run's last step ({total}): no "
                    "trace is taken")
    return said


def warn_degenerate(config, task, start: int) -> None:
    """Each `degenerate_setup` sentence as a warning, for a run that starts at step 0 (a resume said them already)."""
    if start > 0:
        return
    for text in degenerate_setup(config, task):
        warnings.warn(text, JaxtuneWarning, stacklevel=4)
