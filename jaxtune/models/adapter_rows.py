"""Several LoRA adapters in one batch: row b of a batch runs through adapter `adapter_B[b]` (0: none, the base).

A module holding stacked adapters (`methods/adapter_rows.py`) carries `stack_a` [L, N+1, in, R] and `stack_b`
[L, N+1, R, out], each adapter's scale already folded into its B (slot 0 zeros). The layer scan slices one layer,
[N+1, in, R]; `rows_of` gathers each row's adapter from it, `row_a` [B, in, R] and `row_b` [B, R, out], so only one
layer's rows exist at a time (never [L, B, in, R]), and the dense hook `ROW_HOOK` adds (x_b A_b) B_b row by row
(S-LoRA's and Punica's batched LoRA, as batched matmuls; `kv_cache.extend` runs it where rows name adapters). A
decode step multiplies by all N+1 adapters and masks instead (`_row_branch`: it reads each adapter once, not once a
row; faster on a GPU at 64 and 256 rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config.method import Branch, DenseHook, MethodConfig
from jaxtune.errors import JaxtuneError

STACK_LEAVES = ("stack_a", "stack_b")


def stack_size(params: dict) -> int:
    """N+1, the slots of the adapter stacks `params` carries (slot 0 the base), or 0 without stacks."""
    return next((m["stack_a"].shape[1] for m in params["layers"].values()
                 if isinstance(m, dict) and "stack_a" in m), 0)


def adapter_slots(params: dict, method: MethodConfig | None, adapter_of_row: Sequence[int] | None, rows: int,
                  batch: int) -> np.ndarray | None:
    """[batch] int32: the stack slot of each of `rows` prompts (0 for rows that pad the batch); None without
    stacks. A one-line JaxtuneError for slots that do not fit `params`."""
    slots = stack_size(params)
    if not slots:
        if adapter_of_row is not None:
            raise JaxtuneError("adapter_of_row names adapters, but params carry no adapter stacks (stack them with "
                               "jaxtune.spine.model.load_adapters)")
        return None
    if method is not None:
        raise JaxtuneError(f"params carry stacked adapters: each row's comes from adapter_of_row, so pass no method "
                           f"(got {method.kind})")
    if adapter_of_row is None:
        raise JaxtuneError(f"params carry {slots - 1} stacked adapters: name each prompt's slot with adapter_of_row "
                           "(0: the base model)")
    if len(adapter_of_row) != rows:
        raise JaxtuneError(f"adapter_of_row has {len(adapter_of_row)} entries for {rows} prompts")
    bad = next((i for i, a in enumerate(adapter_of_row)
                if isinstance(a, bool) or not isinstance(a, int | np.integer) or not 0 <= a < slots), None)
    if bad is not None:
        raise JaxtuneError(f"adapter_of_row[{bad}] = {adapter_of_row[bad]!r}: an adapter slot is an integer in "
                           f"[0, {slots}) (0: the base model)")
    return np.pad(np.asarray(adapter_of_row, np.int32), (0, batch - rows))


def rows_of(layer: dict, adapter_B: jax.Array | None) -> dict:
    """One layer's modules with each stack [N+1, ...] replaced by its rows' adapters, `row_a` [B, in, R] and
    `row_b` [B, R, out]; `layer` as it is for adapter_B None."""
    if adapter_B is None:
        return layer

    def rows(module):
        if not isinstance(module, dict) or "stack_a" not in module:
            return module
        return {**module, "row_slot": adapter_B, "row_a": jnp.take(module["stack_a"], adapter_B, axis=0),
                "row_b": jnp.take(module["stack_b"], adapter_B, axis=0)}

    return {name: rows(module) for name, module in layer.items()}


def _row_branch(x: jax.Array, y: jax.Array, module: dict, kernel, branch: Branch) -> jax.Array:
    """y + (x_b A_b) B_b for each row b: x [B, T, in], `row_a` [B, in, R], `row_b` [B, R, out] (scales folded in).

    A decode step (T = 1) instead multiplies each row by every slot's A and B, [in, (N+1) R] and [(N+1) R, out],
    keeping its own slot's ranks (a one-hot mask): it reads the N+1 adapters once rather than B gathered copies.
    XLA drops whichever form is not used."""
    if x.shape[-2] == 1:
        xa_BxTxNxR = jnp.einsum("bti,nir->btnr", x, module["stack_a"].astype(x.dtype))
        own_BxN = jax.nn.one_hot(module["row_slot"], module["stack_a"].shape[0], dtype=x.dtype)
        xa_BxTxNxR = xa_BxTxNxR * own_BxN[:, None, :, None]
        return y + jnp.einsum("btnr,nro->bto", xa_BxTxNxR, module["stack_b"].astype(x.dtype))
    xa_BxTxR = jnp.einsum("bti,bir->btr", x, module["row_a"].astype(x.dtype))
    return y + jnp.einsum("btr,bro->bto", xa_BxTxR, module["row_b"].astype(x.dtype))


ROW_HOOK = DenseHook("row_a", add=_row_branch)  # not a method's (nothing trains it): the cache runs it with stacks
