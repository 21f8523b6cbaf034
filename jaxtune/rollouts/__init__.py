"""Rollouts for RL sampling. An external sampler (`external_sampler.py`: a vLLM, vLLM-TPU or SGLang server beside the
trainer, spoken to as `openai_protocol.py` writes) takes the policy as a PEFT adapter or merged weights and returns
completions with their per-token log-probs."""

from jaxtune.rollouts.external_sampler import ExternalSampler as ExternalSampler
from jaxtune.rollouts.external_sampler import ExternalSamplerConfig as ExternalSamplerConfig
from jaxtune.rollouts.external_sampler import sample_group_external as sample_group_external
