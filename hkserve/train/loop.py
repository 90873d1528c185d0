"""The training loop: resume from the latest checkpoint, step through the data stream, log every
step, validate and checkpoint on schedule.

Resumption is exact: the checkpoint holds the full state (including the carry in the middle of a
sequence) and the batch of a step depends only on (seed, step), so the step after a restore computes
what the uninterrupted run computed. Tests prove it by a crash at a known point: with
HKSERVE_TRAIN_KILL_AFTER_STEP=N in the environment the process SIGKILLs itself right after step N is
logged (and checkpointed, if due), with no race against an outside killer.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time

import jax
from tqdm import tqdm

from hkserve.train.data import TrainStream
from hkserve.train.metrics import MetricsLog
from hkserve.train.session import Session
from hkserve.train.step import TrainState

KILL_AFTER_STEP_ENV = "HKSERVE_TRAIN_KILL_AFTER_STEP"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def train(session: Session, progress: bool = True) -> TrainState:
    """Run from the latest checkpoint (or from scratch) to the config's step count → the final state."""
    cfg = session.cfg
    stream = TrainStream(session.ids("train"), cfg.batch_size, cfg.sequence_len, cfg.update_len, cfg.seed)
    latest = session.checkpoints.latest_step()
    state = session.fresh_state() if latest is None else session.restore(latest)
    start = int(state.step)
    if latest is not None:
        _log(f"resuming from the checkpoint at step {latest} in {session.checkpoints.directory}")
    log = MetricsLog(cfg.metrics, start)
    bar = tqdm(total=cfg.steps, initial=start, file=sys.stderr, disable=not progress, unit="step", dynamic_ncols=True)
    tokens_per_step = cfg.batch_size * cfg.update_len
    kill_after = int(os.environ.get(KILL_AFTER_STEP_ENV, "0"))
    try:
        for step in range(start, cfg.steps):
            began = time.perf_counter()
            if stream.starts_sequence(step):
                state = state._replace(carry=session.model.init_carry(cfg.batch_size))
            batch = stream.batch_at(step)
            state, metrics = session.train_step(state, batch)
            metrics = {k: float(v) for k, v in jax.device_get(metrics)._asdict().items()}
            elapsed = time.perf_counter() - began
            if not math.isfinite(metrics["loss"]):
                raise RuntimeError(
                    f"loss is {metrics['loss']} at step {step + 1}; resume from the last checkpoint "
                    f"with a lower lr or tighter grad_clip"
                )
            n_bytes = int(session.byte_lengths[batch.targets].sum())
            bpb = metrics["nll"] * tokens_per_step / math.log(2) / max(n_bytes, 1)
            log.write({"step": step + 1, **metrics, "bits_per_byte": bpb, "tokens_per_s": tokens_per_step / elapsed})
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", bpb=f"{bpb:.3f}", tok_s=f"{tokens_per_step / elapsed:.0f}")
            done = step + 1
            if done % cfg.eval.every == 0 or done == cfg.steps:
                val = session.evaluate(state, "validation", cfg.eval.batches)
                log.write({"step": done, "split": "validation", **val._asdict()})
                bar.write(
                    f"step {done}: validation loss {val.loss:.4f}, {val.bits_per_byte:.4f} bits/byte", file=sys.stderr
                )
                if done % cfg.checkpoint.every == 0 or done == cfg.steps:
                    session.checkpoints.save(state, val.loss)
            if done == kill_after:  # a crash, as abrupt as a real one: nothing after this runs
                os.kill(os.getpid(), signal.SIGKILL)
    finally:
        bar.close()
        log.close()
    return state
