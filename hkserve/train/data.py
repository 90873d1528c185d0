"""Text → token ids → batches for Transformer-VQ style training and for evaluation.

Training: the split's ids are cut into `batch` rows, each a contiguous stream. A row is read in
windows of `sequence_len` tokens (+1 for the shifted targets) and a window in `update_len` chunks:
optimizer step s reads chunk s % chunks of window w(s) in every row, and the model carries its
attention state from one chunk to the next of the same window. The window order is a permutation
per epoch drawn from (seed, epoch), so a step's batch is a pure function of (seed, step): a resumed
run reads exactly the batches the interrupted one would have.

Evaluation: every token of the split is predicted once, in sequences of `sequence_len` with the
state carried over their chunks; the tail is padded and masked out.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from hkserve.checkpoint.tokenizer import Tokenizer

SPLITS = ("train", "validation", "test")


class Batch(NamedTuple):
    inputs: np.ndarray  # [B, U] int32 token ids
    targets: np.ndarray  # [B, U] int32 next-token ids
    mask: np.ndarray  # [B, U] float32: 1 where the target is real text, 0 on padding


def read_splits(data) -> dict[str, str]:
    """{split: text} from a config's `data:` section. One `text` file is cut at the line end nearest
    each fraction, so no split starts mid-line."""
    if data.text is None:
        return {
            name: Path(getattr(data, name)).read_text(encoding="utf-8")
            for name in SPLITS
            if getattr(data, name) is not None
        }
    text = Path(data.text).read_text(encoding="utf-8")
    splits, start, done = {}, 0, 0.0
    for name in SPLITS:
        fraction = getattr(data.split, name)
        if fraction == 0:
            continue
        done += fraction
        line_end = text.find("\n", int(done * len(text)))
        end = len(text) if done >= 1 - 1e-9 or line_end < 0 else line_end + 1
        splits[name] = text[start:end]
        start = end
    return splits


def encode(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """[N] int32: BOS, then the text's ids; the BOS makes the first character a scored target too."""
    return np.asarray(tokenizer.encode(text, add_bos=True), np.int32)


class TrainStream:
    """The batch of every optimizer step, as a pure function of (seed, step)."""

    def __init__(self, ids: np.ndarray, batch: int, sequence_len: int, update_len: int, seed: int):
        row_len = len(ids) // batch
        self.windows = (row_len - 1) // sequence_len  # windows per row
        if self.windows < 1:
            raise ValueError(
                f"training text too short: {len(ids)} tokens give rows of {row_len} for batch_size="
                f"{batch}; each row needs sequence_len + 1 = {sequence_len + 1}"
            )
        self.rows = ids[: batch * row_len].reshape(batch, row_len)  # [B, row_len]
        self.sequence_len, self.update_len, self.seed = sequence_len, update_len, seed
        self.chunks = sequence_len // update_len  # optimizer steps per window
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, window permutation), cached

    def starts_sequence(self, step: int) -> bool:
        """True when `step` reads the first chunk of a window: the carried state must be reset."""
        return step % self.chunks == 0

    def window(self, step: int) -> int:
        epoch, index = divmod(step // self.chunks, self.windows)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.windows))
        return int(self._order[1][index])

    def batch_at(self, step: int) -> Batch:
        start = self.window(step) * self.sequence_len + (step % self.chunks) * self.update_len
        tokens = self.rows[:, start : start + self.update_len + 1]  # [B, U + 1]
        return Batch(tokens[:, :-1], tokens[:, 1:], np.ones(tokens[:, 1:].shape, np.float32))


def eval_sequences(
    ids: np.ndarray, batch: int, sequence_len: int, update_len: int, max_groups: int | None = None
) -> Iterator[list[Batch]]:
    """Groups of `batch` sequences, each group as its list of update-sized chunks (state carried
    along the list, reset between groups). Chunks that are all padding are left out."""
    n = len(ids) - 1  # scored targets
    per_group = batch * sequence_len
    groups = -(-n // per_group)
    if max_groups is not None:
        groups = min(groups, max_groups)
    size = groups * per_group
    inputs, targets, mask = (np.zeros(size, dtype) for dtype in (np.int32, np.int32, np.float32))
    used = min(n, size)
    inputs[:used], targets[:used], mask[:used] = ids[:used], ids[1 : used + 1], 1.0
    shape = (groups, batch, sequence_len)
    inputs, targets, mask = inputs.reshape(shape), targets.reshape(shape), mask.reshape(shape)
    for g in range(groups):
        chunks = []
        for start in range(0, sequence_len, update_len):
            piece = slice(start, start + update_len)
            if mask[g, :, piece].any():
                chunks.append(Batch(inputs[g, :, piece], targets[g, :, piece], mask[g, :, piece]))
        yield chunks
