"""Which decoder an objective's rollouts take: its section's `EngineKeys` (GRPO's and RLOO's, their environments'
episodes, distillation's on-policy and seq_kd completions), and `sampled_groups`, the one call they all make (prompts
with images too: `image_decoding`, the padded decode)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxtune.config import MethodConfig, ModelConfig, SamplingConfig
from jaxtune.errors import JaxtuneError, check_choice, check_range
from jaxtune.generation import generate
from jaxtune.image_decoding import PromptImages, decode_with_images
from jaxtune.rollouts.engine import PagePool, sample_groups


@dataclass(frozen=True)
class EngineKeys:
    """rollout_engine: "padded" (`generation.generate`: every row's cache as long as the longest) or "paged"
    (`rollouts.engine`: rollout_slots rows decoding at once over a pool of rollout_pages pages of rollout_page_size
    tokens, 0: as many as no sample waits for, a finished row's slot taking the next sample, a group's prompt
    prefilled once; plain attention caches only; on a mesh its slots split over the data-parallel devices, across
    processes one program over all of them, as the padded decode)."""

    rollout_engine: str = "padded"
    rollout_slots: int = 16
    rollout_page_size: int = 16
    rollout_pages: int = 0

    def __post_init__(self):
        check_choice("rollout_engine", self.rollout_engine, ("padded", "paged"))
        check_range("rollout_slots", self.rollout_slots, 1)
        check_range("rollout_page_size", self.rollout_page_size, 1)
        check_range("rollout_pages", self.rollout_pages, 0)

    @property
    def page_pool(self) -> PagePool | None:
        """The paged engine's pool, None for the padded decode."""
        if self.rollout_engine != "paged":
            return None
        return PagePool(self.rollout_slots, self.rollout_page_size, self.rollout_pages)


def sampled_groups(params: dict, cfg: ModelConfig, prompts: Sequence[Sequence[int]], group_size: int,
                   sampling: SamplingConfig, keys: EngineKeys, *, eos_ids: Sequence[int] | None,
                   method: MethodConfig | None, stop_token_ids: Sequence[int] = (),
                   stop_when: Callable[[int, list[int]], bool] | None = None,
                   images: PromptImages | None = None) -> list[list[int]]:
    """group_size samples of each prompt (group-major: sample g * group_size + j the j-th of prompt g), each ending
    with the EOS or stop token that ended it (`include_stop`), by the decoder `keys` names: greedy, the same tokens
    either way; sampled, the same distribution (the engine folds the key by sample and step). images: the prompts'
    pixel arrays (a vision-language policy), decoded padded (`image_decoding.decode_with_images`)."""
    pool = keys.page_pool
    if images is not None:
        if pool is not None:
            raise JaxtuneError('rollout_engine = "paged" does not take prompts with images yet (its prefill packs '
                               'prompts without their pixel arrays); use rollout_engine = "padded"')
        repeated = [p for p in prompts for _ in range(group_size)]
        rows = PromptImages(images.side, np.repeat(images.pixels, group_size, axis=0))
        return decode_with_images(params, params["vision"], cfg, repeated, rows, sampling, eos_ids=eos_ids,
                                  stop_token_ids=stop_token_ids, method=method, include_stop=True, stop_when=stop_when)
    if pool is not None:
        return sample_groups(params, cfg, prompts, group_size, sampling, pool=pool, eos_ids=eos_ids,
                             stop_token_ids=stop_token_ids, include_stop=True, method=method,
                             stop_when=stop_when).tokens
    repeated = [p for p in prompts for _ in range(group_size)]
    return generate(params, cfg, repeated, sampling, eos_ids=eos_ids, stop_token_ids=stop_token_ids, method=method,
                    include_stop=True, stop_when=stop_when)
