"""Every configuration type, gathered: frozen dataclasses that validate their values where they are set.

    model.py     ModelConfig, RopeScaling: a decoder's architecture
    method.py    MethodConfig: the base of every method's options (each unit declares its own), AdapterForward
    forward.py   ForwardOptions, Remat: how the forward computes
    run.py       a training run's sections: ModelSection, DataConfig, TrainConfig, MeshConfig, OffloadConfig, EvalConfig
    plan.py      TrainPlan: what fixes a run's arrays and its step (the spine's and planner's input; not re-exported)
    sampling.py  SamplingConfig: how generation picks tokens
    vision.py    SiglipConfig, VisionLanguageConfig, ImageProcessingConfig: a vision-language model's image side
"""

from jaxtune.config.forward import REMAT_POLICIES as REMAT_POLICIES
from jaxtune.config.forward import ForwardOptions as ForwardOptions
from jaxtune.config.forward import Remat as Remat
from jaxtune.config.method import MethodConfig as MethodConfig
from jaxtune.config.model import ARCHITECTURES as ARCHITECTURES
from jaxtune.config.model import LINEAR_MODULE_NAMES as LINEAR_MODULE_NAMES
from jaxtune.config.model import ModelConfig as ModelConfig
from jaxtune.config.model import RopeScaling as RopeScaling
from jaxtune.config.model import tiny_config as tiny_config
from jaxtune.config.run import DataConfig as DataConfig
from jaxtune.config.run import EvalConfig as EvalConfig
from jaxtune.config.run import MeshConfig as MeshConfig
from jaxtune.config.run import ModelSection as ModelSection
from jaxtune.config.run import OffloadConfig as OffloadConfig
from jaxtune.config.run import TrainConfig as TrainConfig
from jaxtune.config.sampling import SamplingConfig as SamplingConfig
from jaxtune.config.vision import ImageProcessingConfig as ImageProcessingConfig
from jaxtune.config.vision import SiglipConfig as SiglipConfig
from jaxtune.config.vision import VisionLanguageConfig as VisionLanguageConfig
