"""Orbax checkpoints of the whole TrainState (params, codebook, optimizer state, step, carry).

The step fixes the data position (batches are a function of the step) and the carry is the attention
state in the middle of a sequence, so a restored state continues bit for bit. Saves are synchronous:
when `save` returns, the step is on disk, and a SIGKILL at any moment leaves at worst an unfinished
temporary directory that the next run removes. Kept: the last `keep`, plus the best by validation loss.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from hkserve.train.step import TrainState

_METRIC = "val_loss"


class Checkpoints:
    def __init__(self, directory: Path, keep: int = 3, read_only: bool = False):
        policy = ocp.checkpoint_managers.AnyPreservationPolicy(
            [
                ocp.checkpoint_managers.LatestN(n=keep),
                # BestN keeps the end of the sort: reverse (descending) so that end is the lowest loss
                ocp.checkpoint_managers.BestN(
                    get_metric_fn=lambda m: m[_METRIC], reverse=True, n=1, keep_checkpoints_without_metrics=False
                ),
            ]
        )
        # read_only: a reader (validation, test) must not clean up the temporary directory of a save
        # that a running trainer is writing; it never saves, so its preservation policy never runs.
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=False,
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            best_fn=lambda m: m[_METRIC],
            best_mode="min",
            preservation_policy=policy,
        )
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, state: TrainState, val_loss: float) -> None:
        self.manager.save(int(state.step), args=ocp.args.StandardSave(state), metrics={_METRIC: float(val_loss)})

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def resolve(self, which: str) -> int:
        """`best`, `latest` or a step number → a saved step."""
        steps = self.manager.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoints in {self.directory}")
        if which == "best":
            return self.manager.best_step()
        if which == "latest":
            return self.manager.latest_step()
        if not which.isdigit() or int(which) not in steps:
            raise ValueError(f"checkpoint {which!r} not found in {self.directory} (best | latest | {sorted(steps)})")
        return int(which)

    def restore(self, step: int, like: TrainState) -> TrainState:
        """The state saved at `step`, shaped like `like` (a state or its jax.eval_shape)."""
        target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like)
        return self.manager.restore(step, args=ocp.args.StandardRestore(target))

    def close(self) -> None:
        self.manager.close()
