"""The sections of GRPO (`GRPOConfig`) and of what RLOO shares with it (`RolloutConfig`): rewards or an environment,
the group and its sampling, the clipped objective's keys, the decoder (`EngineKeys`), stop strings, one-step-off
rollouts and an external sampler's keys, each checked in one line naming it."""

from __future__ import annotations

from dataclasses import dataclass

from jaxtune.errors import ConfigError, check_range
from jaxtune.objectives.episode_rollouts import frozen_table
from jaxtune.objectives.losses import GRPO_LOSS_TYPES, SAMPLER_IS_MODES
from jaxtune.objectives.reward_functions import reward_names
from jaxtune.rollouts.decoders import EngineKeys
from jaxtune.rollouts.external_sampler import ExternalSamplerConfig


@dataclass(frozen=True)
class RolloutConfig(EngineKeys):
    """What GRPO and RLOO share. reward: the dotted paths of reward functions (TRL's `reward_funcs`; one string is one
    function), and/or reward_model: a directory `objective = "reward"` exported, scored after the functions (TRL takes
    a reward model among its reward_funcs); reward_weights: one weight each, functions then reward model (TRL's;
    default 1 each). A function returns a number or None per completion (`reward_functions`: None leaves it out of
    that row's weighted sum). group_size completions per prompt, sampled with temperature / top_k / top_p.
    clip: PPO's epsilon (TRL's `epsilon`), the ratio clipped to [1 - clip, 1 + epsilon_high]; epsilon_high: DAPO's
    clip-higher (0: the same as clip, TRL's None); kl_coef: the KL penalty's beta (TRL's `beta`).
    num_iterations: gradient steps on each rollout batch (TRL's, GRPO's mu): the batch is sampled once, with the
    learner's per-token log-probs at sampling time (`old_logps`), which the clipped ratio divides by in the later
    steps. mask_truncated_completions: a completion that did not end with EOS gets no loss (DAPO's overlong
    filtering; TRL's). soft_punish_cache: DAPO's soft overlong punishment (eq. 13; TRL's
    `get_soft_overlong_punishment` with max_completion_len = max_new_tokens) added to the reward: 0 for a completion
    of at most max_new_tokens - soft_punish_cache tokens (its EOS counted), then falling linearly to -1 at
    max_new_tokens (0: none). environment: instead of a reward, episodes of several turns in an environment (a
    registered name such as "tools", or a dotted path; `jaxtune.environments`) built with `environment_options` (a
    TOML table), max_new_tokens a turn, the loss on every token the model sampled (`episode_rollouts`).
    rollout_engine, rollout_slots, rollout_page_size, rollout_pages: the decoder (`EngineKeys`), for single-turn
    completions and an environment's turns alike.
    off_policy_steps: 0, or 1 for one-step-off rollouts (verl's one_step_off_policy; TRL's experimental AsyncGRPO
    bounds the same lag with max_staleness): the batch of step t + 1 is sampled with the parameters step t starts from,
    before step t is dispatched, and scored while it runs; its `old_logps` are those parameters' (the behaviour
    policy, one update behind the learner), or with GRPO's sampler_importance_sampling_correction its
    `sampler_logps`, the ratio then of the step's own parameters and the policy term weighted by the truncated or
    masked importance weights (`losses.sampler_weights`). Steps 1 and 2 both take batches of the initial parameters.
    stop_strings: a completion also ends once its text holds one of them (either engine; `jaxtune.stop_strings`,
    checked every 16 decode steps, a token whose own text holds one ending it at once). Its tokens end with the one
    that completed the string: the loss credits the sampled tokens that stopped it, as it credits an EOS; the reward
    sees the text cut before the string (what TRL passes from vLLM's `stop`, as an EOS is not in the text), and
    mask_truncated_completions counts it as ended. Not with an environment (its turns end by its own rules) or an
    external sampler."""

    reward: tuple = ()
    reward_model: str = ""
    reward_weights: tuple = ()
    environment: str = ""
    environment_options: tuple = ()
    stop_strings: tuple = ()
    sampler_url: str = ""
    sampler_model: str = ""
    sampler_adapter_dir: str = ""
    sampler_server_adapter_dir: str = ""
    sampler_server: str = "vllm"
    sampler_weights: str = "lora"
    sampler_push_every: int = 1
    sampler_timeout_s: float = 600.0
    group_size: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    clip: float = 0.2
    epsilon_high: float = 0.0
    kl_coef: float = 0.04
    num_iterations: int = 1
    off_policy_steps: int = 0
    mask_truncated_completions: bool = False
    soft_punish_cache: int = 0

    def __post_init__(self):
        super().__post_init__()
        rewards = (self.reward,) if isinstance(self.reward, str) else tuple(self.reward)
        object.__setattr__(self, "reward", () if rewards == ("",) else rewards)  # "": none, as before lists
        if not all(isinstance(r, str) and r for r in self.reward):
            raise ConfigError("reward", list(self.reward), "must be a list of dotted paths (non-empty strings)")
        object.__setattr__(self, "reward_weights", tuple(self.reward_weights))
        if not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in self.reward_weights):
            raise ConfigError("reward_weights", list(self.reward_weights), "must be a list of numbers")
        given = len(self.reward) + bool(self.reward_model)
        if self.reward_weights and len(self.reward_weights) != given:
            raise ConfigError("reward_weights", list(self.reward_weights), f"has {len(self.reward_weights)} weights "
                              f"for {given} rewards ({len(self.reward)} in reward"
                              f"{' + reward_model' if self.reward_model else ''}); give one each, or none (all 1)")
        names = reward_names(self)
        if len(set(names)) < len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ConfigError("reward", list(self.reward), f"names two rewards {twice!r} (their metrics would be one); "
                              "give each a function of its own name")
        if self.group_size < 2:
            raise ConfigError("group_size", self.group_size, "must be >= 2 (advantages are relative to the group)")
        if not self.temperature > 0:
            raise ConfigError("temperature", self.temperature, "must be > 0 (the samples of a group must differ)")
        check_range("max_new_tokens", self.max_new_tokens, 1)
        check_range("top_k", self.top_k, 0)
        check_range("top_p", self.top_p, 0, 1, low_open=True)
        check_range("clip", self.clip, 0, low_open=True)
        if self.epsilon_high and not self.epsilon_high >= self.clip:
            raise ConfigError("epsilon_high", self.epsilon_high, f"must be >= clip = {self.clip} (or 0: the same)")
        check_range("epsilon_high", self.epsilon_high, 0)
        check_range("kl_coef", self.kl_coef, 0)
        check_range("num_iterations", self.num_iterations, 1)
        check_range("off_policy_steps", self.off_policy_steps, 0, 1)
        check_range("soft_punish_cache", self.soft_punish_cache, 0, self.max_new_tokens)
        options = self.environment_options
        options = options.items() if isinstance(options, dict) else options
        if not all(isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) for p in options):
            raise ConfigError("environment_options", self.environment_options, "must be a table of option = value")
        object.__setattr__(self, "environment_options", frozen_table(dict(options)) if options else ())
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ConfigError("stop_strings", self.stop_strings, "must be a list of non-empty strings")
        if self.stop_strings and (self.environment or self.sampler_url):
            raise ConfigError("stop_strings", self.stop_strings, "ends completions jaxtune samples, not an "
                              "environment's turns or an external sampler's; unset one of them")
        self.external_sampler  # noqa: B018  its checks, named as these keys
        if self.environment and self.sampler_url:
            raise ConfigError("sampler_url", self.sampler_url, "an environment's episodes are sampled by jaxtune "
                              "(each turn answered before the next); unset one of sampler_url and environment")
        if self.environment and (self.soft_punish_cache or self.mask_truncated_completions):
            raise ConfigError("environment", self.environment, "episodes end by their environment or at max_seq_len "
                              "(reward 0): soft_punish_cache and mask_truncated_completions apply to one completion")
        if self.off_policy_steps and (self.num_iterations > 1 or self.environment or self.sampler_url):
            key = "num_iterations" if self.num_iterations > 1 else "environment" if self.environment else "sampler_url"
            raise ConfigError("off_policy_steps", self.off_policy_steps, f"one-step-off rollouts are jaxtune's own "
                              f"single-turn samples, one step each; unset {key} or set off_policy_steps = 0")

    @property
    def external_sampler(self) -> ExternalSamplerConfig:
        """The `sampler_*` keys: where rollouts come from when sampler_url is set (`rollouts.external_sampler`)."""
        return ExternalSamplerConfig(self.sampler_url, self.sampler_model, self.sampler_adapter_dir,
                                     self.sampler_server_adapter_dir, self.sampler_server, self.sampler_weights,
                                     self.sampler_push_every, self.sampler_timeout_s)

    @property
    def clip_high(self) -> float:
        """The ratio's upper clip, 1 + clip_high (TRL: epsilon_high if set, else epsilon)."""
        return self.epsilon_high or self.clip


@dataclass(frozen=True)
class GRPOConfig(RolloutConfig):
    """GRPO's section: `RolloutConfig`'s keys and TRL 1.16 GRPOConfig's, named as TRL names them.
    loss_type: how per-token terms become the loss (`losses.grpo_aggregate`): "dapo" (TRL's default, and jaxtune's
    before these keys existed), "grpo", "dr_grpo", "bnpo" or "cispo" (MiniMax-M1: the weight min(ratio,
    epsilon_high), its gradient stopped, times the advantage times log pi; epsilon_high is then the cap itself,
    ScaleRL recommends 5). importance_sampling_level: "token", or "sequence" (GSPO). scale_rewards: "group", "batch"
    or "none" (`reward_functions.grpo_table_advantages`). delta: two-sided clipping's cap on the ratio (INTELLECT-2;
    0: none, TRL's None). multi_objective_aggregation: how several rewards become advantages (TRL's):
    "sum_then_normalize" (their weighted sum, then scale_rewards) or "normalize_then_sum" (GDPO: each normalised
    within its group, the weighted sum normalised over the batch; scale_rewards not read).
    sampler_importance_sampling_correction, _mode, _clip_min, _clip_max: TRL's `vllm_importance_sampling_*` for a
    sampler other than the learner: the batch carries the sampler's per-token log-probs (`sampler_logps`) and the
    policy term is weighted by `losses.sampler_weights` of the learner's log-probs at sampling time over them, mode
    "token_truncate", "token_mask", "sequence_truncate" or "sequence_mask" (TRL's default), bounds 0: none.
    jaxtune's own sampler is the learner: its rollouts carry the learner's log-probs, the weights are 1.
    top_entropy_quantile: the policy term only on the top quantile of each micro-batch's completion tokens by
    entropy (Wang et al. 2025; 1: all). entropy_coef: the entropy bonus, minus entropy_coef times the mean entropy
    of the tokens the loss keeps (`losses.grpo_token_loss`; TRL's static `entropy_coef`)."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    scale_rewards: str = "group"
    multi_objective_aggregation: str = "sum_then_normalize"
    delta: float = 0.0
    sampler_importance_sampling_correction: bool = False
    sampler_importance_sampling_mode: str = "sequence_mask"
    sampler_importance_sampling_clip_min: float = 0.0
    sampler_importance_sampling_clip_max: float = 3.0
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        for key, allowed in (("loss_type", GRPO_LOSS_TYPES), ("importance_sampling_level", ("token", "sequence")),
                             ("scale_rewards", ("group", "batch", "none")),
                             ("multi_objective_aggregation", ("sum_then_normalize", "normalize_then_sum")),
                             ("sampler_importance_sampling_mode", SAMPLER_IS_MODES)):
            if getattr(self, key) not in allowed:
                raise ConfigError(key, getattr(self, key), "choose one of " + ", ".join(allowed))
        if self.delta != 0 and not self.delta > 1:
            raise ConfigError("delta", self.delta, "must be > 1 (a cap on the ratio, which starts at 1; TRL "
                              "recommends > 1 + epsilon_high) or 0: none")
        if self.loss_type == "cispo" and not self.epsilon_high:
            raise ConfigError("epsilon_high", self.epsilon_high, "must be set with loss_type = \"cispo\" (the cap "
                              "on the importance weight itself, e.g. 5.0)")
        low, high = self.sampler_importance_sampling_clip_min, self.sampler_importance_sampling_clip_max
        check_range("sampler_importance_sampling_clip_min", low, 0)
        check_range("sampler_importance_sampling_clip_max", high, 0)
        if low and high and not low < high:
            raise ConfigError("sampler_importance_sampling_clip_min", low, f"must be < "
                              f"sampler_importance_sampling_clip_max = {high}")
        if self.sampler_importance_sampling_mode.endswith("truncate") and not (low or high):
            raise ConfigError("sampler_importance_sampling_clip_max", high, "must be > 0 with a *_truncate mode "
                              "unless sampler_importance_sampling_clip_min is")
        check_range("top_entropy_quantile", self.top_entropy_quantile, 0, 1)
        check_range("entropy_coef", self.entropy_coef, 0)

    @property
    def sampler_clip(self) -> tuple[float | None, float | None]:
        """(C_min, C_max) of `losses.sampler_weights`, None where 0 (no bound)."""
        return (self.sampler_importance_sampling_clip_min or None, self.sampler_importance_sampling_clip_max or None)
