"""Loss and bits per byte of a split: every token predicted once, long sequences read in update-sized
chunks with the attention state carried, exactly as in training.

bits per byte = total NLL in bits / UTF-8 bytes of the scored targets. With the lossless tokenizers of
train.vocab and the BOS that starts each split, those bytes are the whole text of the split.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from hkserve.train.adapter import TrainModel
from hkserve.train.data import eval_sequences


class EvalResult(NamedTuple):
    loss: float  # mean NLL, nats per token
    bits_per_byte: float
    tokens: int  # scored targets
    bytes: int  # UTF-8 bytes those targets stand for


def evaluate(
    model: TrainModel,
    eval_step,
    params,
    codebook,
    ids: np.ndarray,
    byte_lengths: np.ndarray,
    batch: int,
    sequence_len: int,
    update_len: int,
    max_groups: int | None = None,
) -> EvalResult:
    """`eval_step` is train.step.make_eval_step(model); passed in so its compile is reused."""
    total_nll, tokens, n_bytes = 0.0, 0, 0
    for chunks in eval_sequences(ids, batch, sequence_len, update_len, max_groups):
        carry = model.init_carry(batch)
        for chunk in chunks:
            nll, count, carry = eval_step(params, codebook, chunk, carry)
            total_nll += float(nll)
            tokens += int(count)
            n_bytes += int(byte_lengths[chunk.targets][chunk.mask > 0].sum())
    if tokens == 0:
        raise ValueError("nothing to evaluate: the split has no tokens")
    return EvalResult(total_nll / tokens, total_nll / math.log(2) / max(n_bytes, 1), tokens, n_bytes)
