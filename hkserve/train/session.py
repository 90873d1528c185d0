"""Everything one training config determines, built once: tokenizer, split texts and ids, the model,
the optimizer, the compiled steps and the checkpoint directory. `hkserve train`, `validation` and
`test` all start from a Session, so they agree on shapes, data and checkpoints by construction."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from hkserve.train.adapter import build_train_model
from hkserve.train.checkpoints import Checkpoints
from hkserve.train.config import TrainConfig, load_config
from hkserve.train.data import encode, read_splits
from hkserve.train.evaluate import EvalResult, evaluate
from hkserve.train.optim import make_optimizer
from hkserve.train.step import TrainState, init_state, make_eval_step, make_train_step
from hkserve.train.vocab import load_tokenizer, token_byte_lengths


class Session:
    def __init__(self, cfg: TrainConfig, source: str = "config", read_only: bool = False):
        self.cfg, self.source = cfg, source
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self.texts = read_splits(cfg.data)  # {split: text}
        self._ids: dict[str, np.ndarray] = {}
        self.byte_lengths = token_byte_lengths(self.tokenizer)  # [V]
        self.model = build_train_model(cfg.to_model_config(self.tokenizer.vocab_size))
        self.tx, self.schedule = make_optimizer(cfg.optimizer, cfg.steps)
        self.train_step = make_train_step(self.model, self.tx, self.schedule, cfg.vq.commit_beta, cfg.vq.codebook_gamma)
        self.eval_step = make_eval_step(self.model)
        self.checkpoints = Checkpoints(cfg.checkpoint.dir, cfg.checkpoint.keep, read_only=read_only)

    @classmethod
    def open(cls, path: str | Path, read_only: bool = False) -> Session:
        return cls(load_config(path), str(path), read_only)

    def ids(self, split: str) -> np.ndarray:
        """[N] int32 token ids of a split (BOS first), encoded on first use."""
        if split not in self.texts:
            raise ValueError(f"{self.source} has no {split} split")
        if split not in self._ids:
            self._ids[split] = encode(self.tokenizer, self.texts[split])
        return self._ids[split]

    def fresh_state(self) -> TrainState:
        return init_state(self.model, self.tx, self.cfg.seed, self.cfg.batch_size)

    def restore(self, step: int) -> TrainState:
        try:
            return self.checkpoints.restore(step, jax.eval_shape(self.fresh_state))
        except (ValueError, KeyError) as e:  # e.g. a checkpoint of another model size in the same dir
            raise ValueError(
                f"the checkpoint at step {step} in {self.checkpoints.directory} does not fit "
                f"{self.source} ({e}); point checkpoint.dir elsewhere to start anew"
            ) from None

    def evaluate(self, state: TrainState, split: str, max_groups: int | None = None) -> EvalResult:
        cfg = self.cfg
        return evaluate(
            self.model,
            self.eval_step,
            state.params,
            state.codebook,
            self.ids(split),
            self.byte_lengths,
            cfg.batch_size,
            cfg.sequence_len,
            cfg.update_len,
            max_groups,
        )

    def close(self) -> None:
        self.checkpoints.close()
