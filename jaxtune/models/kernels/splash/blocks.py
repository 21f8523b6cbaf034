"""Splash attention's blocks: multiples of the TPU's 128 lanes, the largest of 512, 256, 128 that divides each
length (`splash_block_sizes`), and what that asks of a forward (`splash_covers`)."""

from __future__ import annotations

LANES = 128  # splash's blocks are multiples of the TPU's 128 lanes


def splash_covers(T: int, S: int, prefix: int, masked: bool) -> str | None:
    """Why splash attention cannot run this forward, or None. masked: packed segments or padding present."""
    if T % LANES or S % LANES:
        return f"its blocks are multiples of {LANES} positions; the sequence has {T} queries and {S} keys"
    if prefix and masked:
        return "prefix keys seen by every packed segment or past padding cannot be written as segment ids"
    return None


def splash_block_sizes(T: int, S: int):
    """Splash's `BlockSizes` for T queries over S keys (both multiples of 128): the largest of 512, 256, 128 dividing
    each, the same in the forward and both backward kernels."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    block_q, block_kv = (next(b for b in (512, 256, LANES) if n % b == 0) for n in (T, S))
    return splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv, block_q_dkv=block_q,
                             block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv, block_q_dq=block_q,
                             block_kv_dq=block_kv)


def block_pair(T: int, S: int) -> tuple[int, int]:
    return tuple(next(b for b in (512, 256, LANES) if n % b == 0) for n in (T, S))  # type: ignore[return-value]
