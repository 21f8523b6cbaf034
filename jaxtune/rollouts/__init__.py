"""Rollouts for RL sampling: a paged key/value cache (`paged_cache.py`) and the engine decoding a group's samples with
continuous batching over it (`engine.py`); an external sampler (`external_sampler.py`: a vLLM, vLLM-TPU or SGLang
server beside the trainer, spoken to as `openai_protocol.py` writes) that takes the policy as a PEFT adapter or merged
weights and returns completions with their per-token log-probs."""

from jaxtune.rollouts.engine import PagePool as PagePool
from jaxtune.rollouts.engine import Rollouts as Rollouts
from jaxtune.rollouts.engine import sample_groups as sample_groups
from jaxtune.rollouts.external_sampler import ExternalSampler as ExternalSampler
from jaxtune.rollouts.external_sampler import ExternalSamplerConfig as ExternalSamplerConfig
from jaxtune.rollouts.external_sampler import sample_group_external as sample_group_external
