"""Scale-out: one device mesh ("data", "fsdp", "expert", "context", "tensor"), one rules table from logical axes to
mesh axes, and host offload through memory kinds (the run's shardings are derived in `jaxtune.spine.shardings`).

The public API, one name a line.
"""

from jaxtune.config import MeshConfig as MeshConfig
from jaxtune.config import OffloadConfig as OffloadConfig
from jaxtune.parallel.mesh import abstract_mesh as abstract_mesh
from jaxtune.parallel.mesh import make_mesh as make_mesh
from jaxtune.parallel.offload import low_precision_moments as low_precision_moments
from jaxtune.parallel.rules import RULES as RULES
from jaxtune.parallel.rules import partition_spec as partition_spec
