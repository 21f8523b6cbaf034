"""Rollouts for RL sampling: a paged key/value cache (`paged_cache.py`) and the engine decoding a group's samples with
continuous batching over it (`engine.py`)."""

from jaxtune.rollouts.engine import PagePool as PagePool
from jaxtune.rollouts.engine import Rollouts as Rollouts
from jaxtune.rollouts.engine import sample_groups as sample_groups
