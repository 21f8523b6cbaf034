"""Scale-out: one device mesh ("data", "fsdp", "tensor"), one rules table from logical axes to mesh axes, the
shardings of parameters, optimizer state and batches derived from it, and host offload through memory kinds.

The public API, one name a line.
"""

from jaxtune.config import MeshConfig as MeshConfig
from jaxtune.config import OffloadConfig as OffloadConfig
from jaxtune.parallel.mesh import abstract_mesh as abstract_mesh
from jaxtune.parallel.mesh import make_mesh as make_mesh
from jaxtune.parallel.offload import low_precision_moments as low_precision_moments
from jaxtune.parallel.rules import RULES as RULES
from jaxtune.parallel.rules import partition_spec as partition_spec
from jaxtune.parallel.sharding import batch_sharding as batch_sharding
from jaxtune.parallel.sharding import bytes_per_device as bytes_per_device
from jaxtune.parallel.sharding import optimizer_shardings as optimizer_shardings
from jaxtune.parallel.sharding import param_shardings as param_shardings
from jaxtune.parallel.sharding import sharded_bytes as sharded_bytes
from jaxtune.parallel.sharding import total_bytes as total_bytes
