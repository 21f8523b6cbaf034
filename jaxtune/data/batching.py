"""Fixed-shape batches of packed rows, so the train step compiles once.

    batches = epoch_batches(examples, batch_size, seq_len, seed, epoch)   # dicts of [batch_size, seq_len] arrays

An example of ids x takes inputs x[:-1], labels x[1:], loss mask loss_mask[1:]. Examples share a row, each with its
own segment id (0 is padding) and positions from 0, so none attends to another. Packing (`pack_plan`) is best-fit
decreasing on lengths alone, so the rows, and the steps per epoch, are the same every epoch (`count_epoch_batches`
is exact); only their order changes, drawn from (seed, epoch). `eval_batches` pads each batch only to the
power-of-two bucket of its longest row (`padded_length`): short data is scored at short shapes. Image rows: `ImageRows`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxtune.data.formats import Example
from jaxtune.data.store import example_lengths
from jaxtune.errors import JaxtuneError

# The shortest padded length: shorter buckets (1, 2, 4, 8) would each be a compile and save no measurable memory.
MIN_BUCKET = 16

BATCH_FIELDS = {"input_ids": np.int32, "labels": np.int32, "loss_mask": np.float32, "segment_ids": np.int32,
                "positions": np.int32}  # an SFT batch's arrays and their dtypes


@dataclass(frozen=True)
class ImageRows:
    """Rows of examples with images (`data.image_examples.ImageExample`): at most `max_images` pixel arrays of
    `shape` a row, a batch's `pixel_values` float32 [rows, max_images, *shape] in the order of the row's image
    placeholders (padding arrays are zeros, never placed). Packing is safe: segments keep examples apart and each
    image's placeholders are one span of its own."""

    max_images: int
    shape: tuple[int, ...]


def bucket(n: int, minimum: int = 1) -> int:
    """The padded size for n >= 1: the next power of two, at least `minimum`."""
    return max(minimum, 1 << (n - 1).bit_length())


def padded_length(longest: int, seq_len: int) -> int:
    """The length to pad a batch to whose longest row takes `longest` positions: its power-of-two bucket (at least
    MIN_BUCKET), capped at seq_len."""
    return min(seq_len, bucket(longest, MIN_BUCKET))


def trimmed_to_longest(batch: dict[str, np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    """A batch of [N, seq_len] rows (and [N] fields) with its rows cut to the `padded_length` of the longest (the
    positions its `segment_ids` mark): generated rows are scored at their own bucket, not the cap's."""
    T = padded_length(int(batch["segment_ids"].astype(bool).sum(1).max(initial=1)), seq_len)
    return {k: v[:, :T] if v.ndim == 2 else v for k, v in batch.items()}


def _lengths(examples: Sequence[Example], seq_len: int) -> list[int]:
    """Input positions each example takes (len(ids) - 1), checked against seq_len; a store's from its offsets,
    without reading its tokens."""
    if seq_len < 1:
        raise JaxtuneError(f"seq_len={seq_len} must be at least 1")
    lengths = (example_lengths(examples) - 1).tolist()
    longest = max(lengths, default=0)
    if longest > seq_len:
        raise JaxtuneError(f"an example of {longest + 1} tokens does not fit seq_len={seq_len} "
                           f"(it takes {longest} positions); load the data with max_seq_len <= seq_len + 1")
    return lengths


def pack_plan(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Rows as lists of example indices: best-fit decreasing bin packing of `lengths` into bins of seq_len.

    A function of the lengths alone (ties broken by index). Items of length 0 (a lone token: nothing to
    predict) are left out.
    """
    order = [i for i in np.argsort(-np.asarray(lengths, np.int64), kind="stable").tolist() if lengths[i] > 0]
    rows: list[list[int]] = []
    spaces: list[int] = []  # sorted distinct free space of the open rows
    rows_with: dict[int, list[int]] = {}  # free space -> rows with that much
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(spaces, n)
        if k == len(spaces):  # fits no open row
            r, space = len(rows), seq_len
            rows.append([])
        else:
            space = spaces[k]
            r = rows_with[space].pop()
            if not rows_with[space]:
                del rows_with[space], spaces[k]
        rows[r].append(i)
        left = space - n
        if left:
            if left not in rows_with:
                bisect.insort(spaces, left)
                rows_with[left] = []
            rows_with[left].append(r)
    return rows


def _plan(examples: Sequence[Example], seq_len: int, pack: bool, images: ImageRows | None = None
          ) -> list[list[int]]:
    lengths = _lengths(examples, seq_len)
    rows = pack_plan(lengths, seq_len) if pack else [[i] for i, n in enumerate(lengths) if n > 0]
    return rows if images is None else _within_images(examples, rows, images.max_images)


def _within_images(examples: Sequence, rows: list[list[int]], max_images: int) -> list[list[int]]:
    """Packed rows split, in order, where the next example's images would pass `max_images` a row."""
    out: list[list[int]] = []
    for row in rows:
        held = max_images + 1
        for i in row:
            n = examples[i].images
            if n > max_images:
                raise JaxtuneError(f"an example holds {n} pixel arrays (images and their crops); [data] "
                                   f"max_images_per_row = {max_images} must be at least that")
            if held + n > max_images:
                out.append([])
                held = 0
            out[-1].append(i)
            held += n
    return out


def _fill(examples: Sequence[Example], rows: Sequence[Sequence[int]], seq_len: int, num_rows: int,
          images: ImageRows | None = None) -> dict:
    """Arrays [num_rows, seq_len] holding `rows` (lists of example indices) then empty rows (and `pixel_values`)."""
    out: dict[str, np.ndarray] = {k: np.zeros((num_rows, seq_len), dtype) for k, dtype in BATCH_FIELDS.items()}
    if images is not None:
        out["pixel_values"] = np.zeros((num_rows, images.max_images, *images.shape), np.float32)
        with_images: Sequence[Any] = examples  # `ImageExample`s
        for r, row in enumerate(rows):
            arrays = [with_images[i].pixel_values for i in row if with_images[i].images]
            if arrays:
                stacked = np.concatenate(arrays)
                out["pixel_values"][r, :len(stacked)] = stacked
    for r, row in enumerate(rows):
        t = 0
        for segment, i in enumerate(row, 1):
            ids, mask = examples[i].ids, examples[i].loss_mask
            n = len(ids) - 1
            out["input_ids"][r, t:t + n] = ids[:-1]
            out["labels"][r, t:t + n] = ids[1:]
            out["loss_mask"][r, t:t + n] = mask[1:]
            out["segment_ids"][r, t:t + n] = segment
            out["positions"][r, t:t + n] = np.arange(n)
            t += n
    return out


def pack_rows(examples: Sequence[Example], seq_len: int) -> dict[str, np.ndarray]:
    """All examples packed into rows: a dict of [N, seq_len] arrays (input_ids, labels, loss_mask float32,
    segment_ids, positions; zeros on padding), in `pack_plan` order."""
    rows = _plan(examples, seq_len, pack=True)
    return _fill(examples, rows, seq_len, len(rows))


class EpochBatches(Sequence):
    """One epoch's batches, each a dict of [batch_size, seq_len] arrays built from its rows when it is read, so an
    epoch holds its plan (example indices a row), not its tokens."""

    def __init__(self, examples: Sequence[Example], rows: list[list[int]], batch_size: int, seq_len: int,
                 images: ImageRows | None = None):
        self.examples, self.rows, self.batch_size, self.seq_len = examples, rows, batch_size, seq_len
        self.images = images

    def __len__(self) -> int:
        return math.ceil(len(self.rows) / self.batch_size)

    def __getitem__(self, b):
        if isinstance(b, slice):
            return [self[i] for i in range(*b.indices(len(self)))]
        if not -len(self) <= b < len(self):
            raise IndexError(f"batch {b} of {len(self)}")
        b %= len(self)
        rows = self.rows[b * self.batch_size:(b + 1) * self.batch_size]
        return _fill(self.examples, rows, self.seq_len, self.batch_size, self.images)  # extra rows: zeros


def epoch_batches(examples: Sequence[Example], batch_size: int, seq_len: int, seed: int, epoch: int,
                  pack: bool = True, images: ImageRows | None = None) -> EpochBatches:
    """One epoch of batches, each a dict of [batch_size, seq_len] arrays (see `pack_rows`), built as they are read.

    Rows are packed (or one example a row when pack=False) independently of the shuffle, then ordered by a
    permutation from numpy's Generator seeded with (seed, epoch): same seed and epoch, same batches. images: the
    examples' pixel arrays go with their rows (`ImageRows`).
    """
    if batch_size < 1:
        raise JaxtuneError(f"batch_size={batch_size} must be at least 1")
    rows = _plan(examples, seq_len, pack, images)
    order = np.random.default_rng([seed, epoch]).permutation(len(rows))
    return EpochBatches(examples, [rows[j] for j in order], batch_size, seq_len, images)


def count_epoch_batches(examples: Sequence[Example], batch_size: int, seq_len: int, pack: bool = True) -> int:
    """The number of batches `epoch_batches` returns, the same for every seed and epoch (steps per epoch)."""
    if batch_size < 1:
        raise JaxtuneError(f"batch_size={batch_size} must be at least 1")
    return math.ceil(count_epoch_rows(examples, seq_len, pack) / batch_size)


def count_epoch_rows(examples: Sequence[Example], seq_len: int, pack: bool = True,
                     images: ImageRows | None = None) -> int:
    """The rows of data an epoch's batches hold (packed, or one example a row), the same every epoch."""
    return len(_plan(examples, seq_len, pack, images))


def eval_batches(examples: Sequence[Example], batch_size: int, seq_len: int) -> list[dict[str, np.ndarray]]:
    """Batches for a score summed over examples (order does not matter), each a dict of [batch_size, T] arrays as
    `pack_rows` gives them, T the `padded_length` of the batch's longest row.

    Examples are packed into rows of the bucket of the longest example, not of seq_len (the cap, e.g. the model's
    context), and rows go fullest first, so a batch's rows are of like length. T is a power of two from MIN_BUCKET
    up, or seq_len: the step compiles once per bucket.
    """
    if batch_size < 1:
        raise JaxtuneError(f"batch_size={batch_size} must be at least 1")
    lengths = _lengths(examples, seq_len)
    rows = pack_plan(lengths, padded_length(max(lengths, default=1), seq_len))
    used = [sum(lengths[i] for i in row) for row in rows]
    order = sorted(range(len(rows)), key=lambda r: -used[r])
    chunks = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    return [_fill(examples, [rows[r] for r in chunk], padded_length(used[chunk[0]], seq_len), batch_size)
            for chunk in chunks]
