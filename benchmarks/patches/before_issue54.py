"""jaxtune's products as they were before issue 54, for `paired_step.py`: below float32 every dot returns float32
(rounded after), on every CPU (`linear.product_dtype` returns the accumulation dtype)."""

from jaxtune.methods.lora import product
from jaxtune.models import linear

_saved = linear.product_dtype
linear.product_dtype = product.product_dtype = lambda out_dtype, accumulate: accumulate


def undo():
    linear.product_dtype = product.product_dtype = _saved
