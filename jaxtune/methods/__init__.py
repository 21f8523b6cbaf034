"""The fine-tuning methods, one unit each (`base.py` says what a unit declares), registered here in this order.

Adding a method: a module beside these that builds a `Method`, and its `register` line below.
"""

from jaxtune.methods.adapter import ADAPTER
from jaxtune.methods.base import METHODS as METHODS
from jaxtune.methods.base import Method as Method
from jaxtune.methods.base import method_unit as method_unit
from jaxtune.methods.base import register
from jaxtune.methods.full import FULL
from jaxtune.methods.ia3 import IA3
from jaxtune.methods.lora import LORA, QLORA
from jaxtune.methods.prefix import PREFIX

for unit in (FULL, LORA, QLORA, IA3, PREFIX, ADAPTER):
    register(unit)
