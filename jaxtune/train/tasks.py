"""What each objective adds to the one training loop: a `Task`.

`fine_tune` (loop.py) owns what every objective shares: the donated, sharded step, checkpoints and exact resume,
SIGTERM/SIGINT saves, non-finite skips, metrics.jsonl, loss.png, progress, when to evaluate, and the export call.
A task supplies the rest:

    state, aux      the train state (placed on the mesh) and the step's second argument: the frozen weights, with
                    the reference (dpo, grpo) or the teacher (distill) where the objective has one
    step            (state, aux, batch) -> (state, metrics), one jit with the run's shardings, state donated
    batch(e, i, s)  host arrays [A, rows, ...] of step i of epoch e, a function of (data.seed, e, i) only; for grpo
                    also of the params in state s, which a resumed run restores exactly
    evaluate(p)     held-out metrics {"eval_...": float} of the combined params p
    export(d, p)    writes the result under run directory d, returns its path

    objective  data                rows of a micro-batch         step metrics                 eval metrics
    sft        SFT JSONL           batch_size (packed)           loss                         eval_loss, eval_perplexity
    dpo        {prompt,chosen,     2 x batch_size: chosen rows,  loss, rewards/chosen,        eval_loss, eval_rewards/...
               rejected}           then rejected rows            rewards/rejected, /margin, /accuracy
    reward     the same            the same                      loss, accuracy, margin       eval_loss, eval_accuracy, eval_margin
    grpo       {prompt, ...}       batch_size x group_size       loss, reward, kl             eval_reward (greedy)
    distill    SFT JSONL           batch_size (packed)           loss, kl, nll                eval_loss, eval_kl, eval_nll

The result is adapter/ (PEFT) or model/ (HF, full fine-tune), except for a reward model: reward_model/, an HF
`*ForSequenceClassification` directory (see `reward.py`), adapters merged.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jaxtune.config import ForwardOptions, ModelConfig, SamplingConfig
from jaxtune.data.batching import count_epoch_batches, epoch_batches
from jaxtune.data.formats import load_preference_examples, load_prompt_examples, load_sft_examples, train_eval_split
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.generation import generate
from jaxtune.methods.transform import apply_method, combine, partition, trainable_mask
from jaxtune.models.hf_weights import load_model
from jaxtune.parallel.offload import low_precision_moments
from jaxtune.parallel.placement import (
    TrainShardings,
    init_sharded_state,
    shard_eval_step,
    shard_train_step,
    train_shardings,
)
from jaxtune.parallel.sharding import param_shardings
from jaxtune.run_config import RunConfig
from jaxtune.train.distill import check_teacher, make_distill_eval, make_distill_step
from jaxtune.train.evaluation import evaluate
from jaxtune.train.export import export_result
from jaxtune.train.grpo import load_reward_function, make_grpo_step, reward_model_function, rollout_batch, sample_group
from jaxtune.train.metrics import perplexity
from jaxtune.train.preference import (
    make_preference_eval,
    make_preference_step,
    preference_batches,
    reference_logps,
    strip_adapters,
)
from jaxtune.train.reward import add_reward_head, make_reward_eval, make_reward_step, save_reward_model
from jaxtune.train.step import learning_rate_schedule, make_eval_step, make_optimizer, make_train_step


@dataclass(frozen=True)
class Setup:
    """What every task starts from: the run's config, mesh, base model and tokenizer."""

    config: RunConfig
    mesh: Mesh
    cfg: ModelConfig
    base: dict
    tokenizer: Tokenizer
    options: ForwardOptions
    log: Callable[[str], None]


@dataclass(frozen=True)
class Task:
    """One objective's part of a run (see the module docstring); `frozen` and `shardings` are the policy's."""

    steps_per_epoch: int
    total_steps: int
    state: dict
    frozen: dict
    aux: object
    shardings: TrainShardings
    step: Callable
    batch: Callable[[int, int, dict], dict]
    evaluate: Callable[[dict], dict] | None
    export: Callable[[Path, dict], Path]


def stack_micro_batches(batches: list[dict], grad_accum: int, index: int) -> dict:
    """Micro-batches index*A .. index*A+A-1 stacked to [A, B, T]; missing ones are empty (no loss tokens)."""
    chunk = batches[index * grad_accum:(index + 1) * grad_accum]
    chunk += [{k: np.zeros_like(v) for k, v in batches[0].items()}] * (grad_accum - len(chunk))
    return {k: np.stack([b[k] for b in chunk]) for k in chunk[0]}


def _epoch_cache(make_batches: Callable[[int], list[dict]], grad_accum: int):
    """`batch(epoch, index, state)` over one epoch's batches, built once per epoch."""
    cache = {}

    def batch(epoch: int, index: int, _state) -> dict:
        if epoch not in cache:
            cache.clear()
            cache[epoch] = make_batches(epoch)
        return stack_micro_batches(cache[epoch], grad_accum, index)

    return batch


@dataclass(frozen=True)
class _Placed:
    state: dict
    frozen: dict
    shardings: TrainShardings
    optimizer: object
    schedule: object
    total_steps: int


def _place(setup: Setup, params: dict, steps_per_epoch: int, rows: int) -> _Placed:
    """Partition `params` by the method, build the optimizer, and create state and frozen weights on the mesh."""
    config = setup.config
    tc = config.train
    total_steps = tc.max_steps or tc.epochs * steps_per_epoch
    trainable, frozen = partition(params, trainable_mask(params, config.method))
    optimizer = make_optimizer(tc, total_steps, trainable)
    if config.offload.moments_dtype != "float32":
        optimizer = low_precision_moments(optimizer, config.offload.moments_dtype)
    shardings = train_shardings(setup.mesh, setup.cfg, trainable, frozen, optimizer, rows, config.offload)
    state = init_sharded_state(trainable, optimizer, tc.seed, shardings)
    frozen = jax.device_put(frozen, shardings.frozen)
    return _Placed(state, frozen, shardings, optimizer, learning_rate_schedule(tc, total_steps), total_steps)


def _shard_step(step, placed: _Placed, aux_shardings):
    """`step(state, aux, batch)` in one jit with the run's shardings; `aux` takes the frozen weights' place and
    batches arrive placed (`loop.place_batch`)."""
    return shard_train_step(step, dataclasses.replace(placed.shardings, frozen=aux_shardings, batch=None))


def _model_params(setup: Setup, key: int = 0) -> dict:
    return apply_method(setup.base, setup.cfg, setup.config.method, jax.random.key(setup.config.train.seed + key))


def _split(setup: Setup, train: list, eval_examples: list | None) -> tuple[list, list]:
    if eval_examples is not None:
        return train, eval_examples
    return train_eval_split(train, setup.config.data.eval_fraction, setup.config.data.seed)


def _export(setup: Setup):
    return lambda run_dir, params: export_result(run_dir, setup.config, setup.cfg, params, setup.config.method)


# --- sft and distill: SFT data ---------------------------------------------------------------------------------

def _train_and_held_out(setup: Setup, load, unit: str) -> tuple[list, list]:
    """(train, held-out) examples read by `load(path, tokenizer, seq_len)` from data.train (and data.eval, else
    a split of train), logged as `unit`."""
    data, seq_len = setup.config.data, setup.config.data.max_seq_len
    examples, stats = load(data.train, setup.tokenizer, seq_len)
    held_out = load(data.eval, setup.tokenizer, seq_len)[0] if data.eval else None
    train, held_out = _split(setup, examples, held_out)
    setup.log(f"data: {len(train)} train / {len(held_out)} eval {unit} ({stats.dropped_prompt_too_long} dropped: "
              f"prompt >= max_seq_len {seq_len}; {stats.truncated} truncated)")
    return train, held_out


def _sft_data(setup: Setup) -> tuple[list, list]:
    return _train_and_held_out(setup, load_sft_examples, "examples")


def _sft_batches(setup: Setup, examples: list, epoch: int) -> list[dict]:
    c = setup.config
    return epoch_batches(examples, c.train.batch_size, c.data.max_seq_len, c.data.seed, epoch, c.data.pack)


def _sft_steps(setup: Setup, train: list) -> int:
    c = setup.config
    return math.ceil(count_epoch_batches(train, c.train.batch_size, c.data.max_seq_len, c.data.pack) / c.train.grad_accum)


def sft_task(setup: Setup) -> Task:
    c, cfg, method = setup.config, setup.cfg, setup.config.method
    train, held_out = _sft_data(setup)
    steps_per_epoch = _sft_steps(setup, train)
    placed = _place(setup, _model_params(setup), steps_per_epoch, c.train.batch_size)
    step = make_train_step(cfg, method, setup.options, placed.optimizer, placed.schedule)
    eval_step = shard_eval_step(make_eval_step(cfg, method, setup.options), placed.shardings)
    eval_batches = _sft_batches(setup, held_out, 0) if held_out else []

    def run_eval(params):
        loss, ppl, tokens = evaluate(eval_step, params, eval_batches)
        return {"eval_loss": loss, "eval_perplexity": ppl, "eval_tokens": tokens}

    return Task(steps_per_epoch, placed.total_steps, placed.state, placed.frozen, placed.frozen, placed.shardings,
                _shard_step(step, placed, placed.shardings.frozen),
                _epoch_cache(lambda e: _sft_batches(setup, train, e), c.train.grad_accum),
                run_eval if eval_batches else None, _export(setup))


def distill_task(setup: Setup) -> Task:
    c, cfg, method, d = setup.config, setup.cfg, setup.config.method, setup.config.distill
    if not d.teacher:
        raise JaxtuneError("[distill] teacher is not set (a model directory with the student's vocabulary)")
    teacher_cfg, teacher = load_model(d.teacher, None if c.model.dtype == "auto" else c.model.dtype)
    check_teacher(cfg, teacher_cfg, f"[distill] teacher {d.teacher}")
    train, held_out = _sft_data(setup)
    steps_per_epoch = _sft_steps(setup, train)
    placed = _place(setup, _model_params(setup), steps_per_epoch, c.train.batch_size)
    teacher_sh = param_shardings(teacher, teacher_cfg, setup.mesh)
    teacher = jax.device_put(teacher, teacher_sh)
    inner = make_distill_step(cfg, teacher_cfg, method, setup.options, placed.optimizer, placed.schedule, d)
    step = lambda state, aux, batch: inner(state, aux["frozen"], aux["teacher"], batch)
    eval_fn = make_distill_eval(cfg, teacher_cfg, method, setup.options, d)
    eval_step = shard_eval_step(lambda params, args: eval_fn(params, *args), placed.shardings)
    eval_batches = _sft_batches(setup, held_out, 0) if held_out else []

    def run_eval(params):
        sums = [eval_step(params, (teacher, b)) for b in eval_batches]
        kl, nll, tokens = (sum(float(s[k]) for s in sums) for k in ("kl", "nll", "tokens"))
        kl, nll = kl / max(tokens, 1), nll / max(tokens, 1)
        return {"eval_loss": d.alpha * kl + (1 - d.alpha) * nll, "eval_kl": kl, "eval_nll": nll,
                "eval_perplexity": perplexity(nll), "eval_tokens": int(tokens)}

    aux = {"frozen": placed.frozen, "teacher": teacher}
    return Task(steps_per_epoch, placed.total_steps, placed.state, placed.frozen, aux, placed.shardings,
                _shard_step(step, placed, {"frozen": placed.shardings.frozen, "teacher": teacher_sh}),
                _epoch_cache(lambda e: _sft_batches(setup, train, e), c.train.grad_accum),
                run_eval if eval_batches else None, _export(setup))


# --- dpo and reward: preference pairs --------------------------------------------------------------------------

def _preference_data(setup: Setup) -> tuple[list, list]:
    return _train_and_held_out(setup, load_preference_examples, "pairs")


def _pair_batches(setup: Setup, pairs: list, epoch: int, reference: np.ndarray | None = None) -> list[dict]:
    c = setup.config
    return preference_batches(pairs, c.train.batch_size, c.data.max_seq_len, c.data.seed, epoch, reference)


def _per_pair(sums: list[dict]) -> dict:
    """Held-out sums over pair batches ({"pairs", metric sums}) as means per pair, named eval_<metric>."""
    totals = {k: sum(float(s[k]) for s in sums) for k in sums[0]}
    pairs = totals.pop("pairs")
    return {f"eval_{k}": v / max(pairs, 1) for k, v in totals.items()} | {"eval_pairs": int(pairs)}


def _reference(setup: Setup, name: str) -> tuple[dict | None, dict | None]:
    """(reference params, their shardings) for `name` ("base" or a model directory), or (None, None) when the
    reference is the frozen base inside the step: adapter methods, no copy."""
    c, cfg = setup.config, setup.cfg
    if name == "base" and c.method.kind != "full":
        return None, None
    if name == "base":
        reference = setup.base
    else:
        ref_cfg, reference = load_model(name, None if c.model.dtype == "auto" else c.model.dtype)
        if ref_cfg.vocab_size != cfg.vocab_size:
            raise JaxtuneError(f"[dpo] reference {name}: vocabulary has {ref_cfg.vocab_size} tokens, the policy's "
                               f"{cfg.vocab_size}; the reference must be the same model shape")
        shapes = lambda tree: jax.tree.map(lambda x: x.shape, tree)
        if shapes(reference) != shapes(setup.base):
            raise JaxtuneError(f"[dpo] reference {name}: parameter shapes differ from {c.model.path}'s; the "
                               "reference must be the same model shape (e.g. the SFT checkpoint)")
    shardings = param_shardings(reference, cfg, setup.mesh)
    return jax.device_put(reference, shardings), shardings


def dpo_task(setup: Setup) -> Task:
    c, cfg, method, p = setup.config, setup.cfg, setup.config.method, setup.config.dpo
    train, held_out = _preference_data(setup)
    steps_per_epoch = math.ceil(len(_pair_batches(setup, train, 0)) / c.train.grad_accum)
    placed = _place(setup, _model_params(setup), steps_per_epoch, 2 * c.train.batch_size)
    reference, reference_sh = _reference(setup, p.reference)
    train_ref = held_out_ref = None
    if p.precompute_reference:
        scorer = strip_adapters(placed.frozen) if reference is None else reference
        train_ref, held_out_ref = (reference_logps(scorer, pairs, cfg, setup.options, p, c.train.batch_size,
                                                   c.data.max_seq_len) for pairs in (train, held_out))
        setup.log(f"reference log-probs precomputed for {len(train)} + {len(held_out)} pairs")
        reference, reference_sh = None, None  # a separate reference model is no longer needed
    inner = make_preference_step(cfg, method, setup.options, placed.optimizer, placed.schedule, p)

    def step(state, aux, batch):
        ref = strip_adapters(aux["frozen"]) if aux["reference"] is None else aux["reference"]
        return inner(state, aux["frozen"], ref, batch)

    eval_fn = make_preference_eval(cfg, method, setup.options, p)
    eval_step = shard_eval_step(
        lambda params, args: eval_fn(params, strip_adapters(params) if args[0] is None else args[0], args[1]),
        placed.shardings)
    eval_batches = _pair_batches(setup, held_out, 0, held_out_ref) if held_out else []
    aux = {"frozen": placed.frozen, "reference": reference}
    return Task(steps_per_epoch, placed.total_steps, placed.state, placed.frozen, aux, placed.shardings,
                _shard_step(step, placed, {"frozen": placed.shardings.frozen, "reference": reference_sh}),
                _epoch_cache(lambda e: _pair_batches(setup, train, e, train_ref), c.train.grad_accum),
                (lambda params: _per_pair([eval_step(params, (reference, b)) for b in eval_batches]))
                if eval_batches else None,
                _export(setup))


def reward_task(setup: Setup) -> Task:
    c, cfg, method = setup.config, setup.cfg, setup.config.method
    if method.kind not in ("full", "lora", "qlora"):
        raise JaxtuneError(f"objective reward exports a sequence-classification model with the adapters merged: "
                           f"[method] kind must be full, lora or qlora, not {method.kind}")
    train, held_out = _preference_data(setup)
    steps_per_epoch = math.ceil(len(_pair_batches(setup, train, 0)) / c.train.grad_accum)
    params = add_reward_head(_model_params(setup), cfg, jax.random.key(c.train.seed + 1))
    placed = _place(setup, params, steps_per_epoch, 2 * c.train.batch_size)
    inner = make_reward_step(cfg, method, setup.options, placed.optimizer, placed.schedule)
    eval_step = shard_eval_step(make_reward_eval(cfg, method, setup.options), placed.shardings)
    eval_batches = _pair_batches(setup, held_out, 0) if held_out else []

    def run_eval(params):
        return _per_pair([eval_step(params, b) for b in eval_batches])

    def export(run_dir: Path, params: dict) -> Path:
        from jaxtune.methods.lora import merge

        merged = params if method.kind == "full" else merge(params, method)
        return save_reward_model(run_dir / "reward_model", cfg, merged, tokenizer_from=c.model.path,
                                 dtype=None if c.model.dtype == "auto" else c.model.dtype)

    return Task(steps_per_epoch, placed.total_steps, placed.state, placed.frozen, placed.frozen, placed.shardings,
                _shard_step(inner, placed, placed.shardings.frozen),
                _epoch_cache(lambda e: _pair_batches(setup, train, e), c.train.grad_accum),
                run_eval if eval_batches else None, export)


# --- grpo: prompts, rollouts from the current policy -----------------------------------------------------------

def grpo_task(setup: Setup) -> Task:
    c, cfg, method, g, tok = setup.config, setup.cfg, setup.config.method, setup.config.grpo, setup.tokenizer
    seq_len, tc = c.data.max_seq_len, c.train
    if bool(g.reward) == bool(g.reward_model):
        raise JaxtuneError("[grpo] set exactly one of reward (a function's dotted path, e.g. 'mypkg.rewards.exact') "
                           "and reward_model (a reward model directory)")
    if c.offload.frozen_params:
        raise JaxtuneError("[offload] frozen_params = true is not supported with objective grpo (rollouts decode "
                           "from the frozen weights every step); set it to false")
    reward_fn = load_reward_function(g.reward) if g.reward else reward_model_function(g.reward_model, seq_len)
    examples = load_prompt_examples(c.data.train)
    held_out = load_prompt_examples(c.data.eval) if c.data.eval else None
    fits = lambda e: len(tok.encode(e.prompt)) + g.max_new_tokens <= seq_len + 1
    train, held_out = _split(setup, [e for e in examples if fits(e)], held_out)
    held_out = [e for e in held_out if fits(e)]
    per_step = tc.batch_size * tc.grad_accum
    setup.log(f"data: {len(train)} train / {len(held_out)} eval prompts ({len(examples) - sum(map(fits, examples))} "
              f"dropped: prompt + max_new_tokens {g.max_new_tokens} > max_seq_len {seq_len} + 1)")
    if len(train) < per_step:
        raise JaxtuneError(f"{c.data.train}: {len(train)} training prompts, fewer than batch_size x grad_accum = "
                           f"{per_step} per step")
    steps_per_epoch = len(train) // per_step  # the last partial chunk of each epoch's shuffle is left out
    placed = _place(setup, _model_params(setup), steps_per_epoch, tc.batch_size * g.group_size)
    reference, reference_sh = _reference(setup, "base")
    inner = make_grpo_step(cfg, method, setup.options, placed.optimizer, placed.schedule, g)

    def step(state, aux, batch):
        ref = strip_adapters(aux["frozen"]) if aux["reference"] is None else aux["reference"]
        return inner(state, aux["frozen"], ref, batch)

    eos = sorted({*cfg.eos_token_id, *([tok.eos_id] if tok.eos_id is not None else [])})

    def rewards(chosen: list, completions: list[list[int]], repeat: int) -> list[float]:
        names = sorted({k for e in chosen for k in e.fields})
        fields = {k: [e.fields.get(k) for e in chosen for _ in range(repeat)] for k in names}
        prompts = [e.prompt for e in chosen for _ in range(repeat)]
        values = reward_fn(prompts, [tok.decode(t) for t in completions], **fields)
        values = np.asarray(values, np.float64) if len(values) == len(completions) else None
        if values is None or not np.all(np.isfinite(values)):
            raise JaxtuneError(f"reward {g.reward or g.reward_model!r} must return one finite number per completion")
        return values.tolist()

    def batch(epoch: int, index: int, state: dict) -> dict:
        order = np.random.default_rng([c.data.seed, epoch]).permutation(len(train))
        chosen = [train[j] for j in order[index * per_step:(index + 1) * per_step]]
        seed = int(np.random.default_rng([tc.seed, epoch, index]).integers(2**31))
        params = combine(state["params"], placed.frozen)
        rows, completions = sample_group(params, cfg, method, [tok.encode(e.prompt) for e in chosen], g, seed, eos)
        rollouts = rollout_batch(rows, completions, rewards(chosen, completions, g.group_size), g.group_size, seq_len)
        return {k: v.reshape(tc.grad_accum, -1, *v.shape[1:]) for k, v in rollouts.items()}

    def run_eval(params):
        greedy = SamplingConfig(max_new_tokens=g.max_new_tokens, temperature=0.0)
        completions = generate(params, cfg, [tok.encode(e.prompt) for e in held_out], greedy, eos_ids=eos,
                               method=method)
        return {"eval_reward": float(np.mean(rewards(held_out, completions, 1)))}

    aux = {"frozen": placed.frozen, "reference": reference}
    return Task(steps_per_epoch, placed.total_steps, placed.state, placed.frozen, aux, placed.shardings,
                _shard_step(step, placed, {"frozen": placed.shardings.frozen, "reference": reference_sh}),
                batch, run_eval if held_out else None, _export(setup))


TASKS = {"sft": sft_task, "dpo": dpo_task, "reward": reward_task, "grpo": grpo_task, "distill": distill_task}
