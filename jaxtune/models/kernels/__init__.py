"""The fused attention kernels, one unit each (`base.py` says what a unit declares), registered here and only here:
splash on TPU, cuDNN on NVIDIA GPUs. A full forward's attention is the kernel `choose_kernel` picks, else the
blockwise kernel (`models/attention.py`); the planner asks the same function (`planner/kernels.py`).

Adding a kernel: a module beside these that builds an `AttentionKernel`, and its entry in the tuple below.
"""

from jaxtune.models.kernels.base import BLOCKWISE as BLOCKWISE
from jaxtune.models.kernels.base import KERNELS as KERNELS
from jaxtune.models.kernels.base import AttentionKernel as AttentionKernel
from jaxtune.models.kernels.base import AttentionShape as AttentionShape
from jaxtune.models.kernels.base import FusedAttention as FusedAttention
from jaxtune.models.kernels.base import FusedAttentionWarning as FusedAttentionWarning
from jaxtune.models.kernels.base import KernelCall as KernelCall
from jaxtune.models.kernels.base import KernelCosts as KernelCosts
from jaxtune.models.kernels.base import RingCall as RingCall
from jaxtune.models.kernels.base import RingKernel as RingKernel
from jaxtune.models.kernels.base import check_choice as check_choice
from jaxtune.models.kernels.base import choose_kernel as choose_kernel
from jaxtune.models.kernels.base import kernel_choices as kernel_choices
from jaxtune.models.kernels.cudnn import CUDNN
from jaxtune.models.kernels.splash import SPLASH

KERNELS.update({kernel.name: kernel for kernel in (SPLASH, CUDNN)})
