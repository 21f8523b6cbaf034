"""jaxtune: plan, run and export fine-tuning of Llama-family language models in JAX.

The public API, one name a line; everything else is internal.
"""

from jaxtune.config import ForwardOptions as ForwardOptions
from jaxtune.config import MeshConfig as MeshConfig
from jaxtune.config import MethodConfig as MethodConfig
from jaxtune.config import ModelConfig as ModelConfig
from jaxtune.config import Remat as Remat
from jaxtune.config import RopeScaling as RopeScaling
from jaxtune.config import SamplingConfig as SamplingConfig
from jaxtune.config.plan import TrainPlan as TrainPlan
from jaxtune.data.tokenizer import Tokenizer as Tokenizer
from jaxtune.data.tokenizer import copy_tokenizer as copy_tokenizer
from jaxtune.data.tokenizer import load_tokenizer as load_tokenizer
from jaxtune.errors import ConfigError as ConfigError
from jaxtune.errors import JaxtuneError as JaxtuneError
from jaxtune.generation import generate as generate
from jaxtune.generation import generate_text as generate_text
from jaxtune.methods.lora import merge as merge
from jaxtune.methods.lora import unmerge as unmerge
from jaxtune.methods.peft import load_peft_adapter as load_peft_adapter
from jaxtune.methods.peft import save_peft_adapter as save_peft_adapter
from jaxtune.methods.targets import lora_layout as lora_layout
from jaxtune.methods.transform import apply_method as apply_method
from jaxtune.methods.transform import combine as combine
from jaxtune.methods.transform import parameter_report as parameter_report
from jaxtune.methods.transform import partition as partition
from jaxtune.methods.transform import trainable_mask as trainable_mask
from jaxtune.models.hf_config import load_config as load_config
from jaxtune.models.hf_weights import save_model as save_model
from jaxtune.models.llama import decoder as decoder
from jaxtune.models.llama import forward as forward
from jaxtune.models.params import abstract_params as abstract_params
from jaxtune.models.params import init_params as init_params
from jaxtune.models.params import logical_axes as logical_axes
from jaxtune.models.params import param_specs as param_specs
from jaxtune.models.quant import dequantize as dequantize
from jaxtune.models.quant import quantize_int8 as quantize_int8
from jaxtune.models.quant import quantize_nf4 as quantize_nf4
from jaxtune.models.reward_model import save_reward_model as save_reward_model
from jaxtune.parallel.distributed import ClusterConfig as ClusterConfig
from jaxtune.parallel.distributed import join_cluster as join_cluster
from jaxtune.run_config import RunConfig as RunConfig
from jaxtune.run_config import load_run_config as load_run_config
from jaxtune.spine.model import load_model as load_model
from jaxtune.spine.model import load_model_with_adapter as load_model_with_adapter
from jaxtune.spine.model import load_reward_model as load_reward_model
from jaxtune.train.evaluation import evaluate_file as evaluate_file
from jaxtune.train.evaluation import evaluate_preference_file as evaluate_preference_file
from jaxtune.train.export import export_merged as export_merged
from jaxtune.train.loop import fine_tune as fine_tune
