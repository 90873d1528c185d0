"""The Engine's prompt prefill (a mixin of Engine, engine.py): a prompt into a slot in chunks of the
prefill buckets (prefix_copy.plan_chunks), its first token sampled by the last chunk; whole (`prefill`,
`score_prefill`: chunks of the largest bucket) or spread over the runner's loop passes (`start_prefill`
/ `continue_prefill`, prefill_job.py), where each pass may replan the chunks still to run at the
bucket its token budget fits (`rechunk`). Spread at the largest bucket, a prefill runs the one-shot
chunks through the same programs (the same bits); at a smaller chunk its KV is the same computation
cut at other places, whose float rounding may differ in the last bits (greedy replies tested equal:
tests/test_step_budget_chunks.py). In the prefix cache's exact mode every prefill keeps its one fixed
chunk (EXACT_CHUNK), whatever the budget, so a reused prefix's KV stays bit-identical to its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import jax
import numpy as np

from hkserve.engine.outputs import PendingScores, PendingTokens
from hkserve.engine.prefill_job import PrefillJob
from hkserve.engine.prefix_cache import Reuse
from hkserve.engine.prefix_copy import check_reuse, plan_chunks, rechunk
from hkserve.engine.state import DecodeStateLost
from hkserve.model.sampling import SamplingParams, make_settings


class PromptPrefill:
    """Engine's prefill entry points; Engine provides the state, programs and paged blocks."""

    # The chunk sizes (buckets) that a runner's token budget may pick for the continuation chunks of a
    # prompt (Scheduler.chunk_sizes), set by the runner before warm-up compiles them; (): the largest.
    chunk_sizes: tuple[int, ...] = ()

    def _prefill_chunk(
        self,
        slot: int,
        piece: list[int],
        attend_len: int,
        bucket: int,
        row,
        following: list[int] | None = None,
        row_mask: np.ndarray | None = None,
        generated_from: int | None = None,
    ):
        """One chunk padded to `bucket` → its sampled-token output; with `following` (the prompt tokens
        after each of the chunk's), the scoring program → (output, scores) instead. `generated_from`:
        the index in the chunk where the request's generated tokens start (None: none are)."""
        self.sync_table()
        args = (self.params, self.state, *self._chunk_args(slot, piece, bucket, row, row_mask, generated_from))
        if following is None:
            self.state, out = self._compiled_fn("prefill", attend_len)(*args)
            return out
        targets = np.zeros((1, bucket), np.int32)
        targets[0, : len(following)] = following
        self.state, out, scored = self._compiled_fn("score", attend_len)(*args, targets)
        return out, scored

    def _chunk_args(self, slot, piece, bucket, row, row_mask=None, generated_from=None) -> tuple:
        """A chunk's host arguments to the prefill program (after the params and the state)."""
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, : len(piece)] = piece
        slot_arr, length = np.asarray([slot], np.int32), np.asarray([len(piece)], np.int32)
        made = np.asarray([bucket if generated_from is None else max(generated_from, 0)], np.int32)
        mask = self._all_allowed if row_mask is None else row_mask
        return tokens, length, slot_arr, made, row, mask

    def prefill(
        self,
        slot: int,
        prompt_ids: Sequence[int],
        settings: SamplingParams | None = None,
        reuse: Reuse | None = None,
        bitmask: np.ndarray | None = None,
        generated: int = 0,
    ) -> PendingTokens:
        """Fill slot `slot` with the prompt (in chunks of the largest bucket) and sample its first token
        (one row). The first chunk is padded to the smallest bucket that holds it; later chunks of a long
        prompt to the largest, so they need one program per window, not one per bucket and window.
        With `reuse`, the prompt's first reuse.length tokens' KV is copied from slot reuse.source (the
        runner's PrefixCache knows it holds them) and only the rest is prefilled.
        A prompt or settings the slot cannot take raise before any device work; a failure after it
        leaves the other slots as they were, or raises DecodeStateLost when it cannot. `bitmask` [1, W]
        int32: the tokens the first sample may take (a grammar's; None allows all). `generated`: the last
        so many of prompt_ids are tokens the request generated before it was preempted (counted for the
        penalties as generated, so it resumes drawing as it would have); a reuse may not reach them."""
        return self._prefill(slot, prompt_ids, settings, None, reuse, bitmask, generated)

    def score_prefill(
        self,
        slot: int,
        prompt_ids: Sequence[int],
        settings: SamplingParams | None = None,
        bitmask: np.ndarray | None = None,
    ) -> tuple[PendingTokens, PendingScores]:
        """`prefill` that also scores the prompt: each token's logprob, rank and the n_top most likely
        alternatives given the tokens before it. Its own compiled programs (per bucket and window), so
        a plain prefill computes nothing for it."""
        chunks: list[tuple[jax.Array, int]] = []
        pending = self._prefill(slot, prompt_ids, settings, chunks, None, bitmask)
        return pending, PendingScores(chunks)

    def start_prefill(self, slot, prompt_ids, settings=None, reuse=None, bitmask=None, generated=0) -> PrefillJob:
        """`prefill` (the same arguments) spread over loop passes (prefill_job.py): the checks, the slot's
        blocks for the whole prompt and the reused prefix's copy now; its chunks by `continue_prefill`."""
        self.check_fits(len(prompt_ids))
        row = make_settings([settings or SamplingParams()], self.model.config.vocab_size)
        start = check_reuse(
            reuse, slot, len(prompt_ids), self.slots, self.positions, self.prefix_cache, self.prefill_chunk
        )
        if generated and start > len(prompt_ids) - generated:  # copied KV counts its tokens as prompt
            raise ValueError("a resuming request may reuse only its prompt's KV")
        plan = plan_chunks(len(prompt_ids), start, self.prefill_buckets, self._window, self.prefill_chunk)
        source_row = self._assign(slot, len(prompt_ids), reuse if start else None)  # paged: its blocks
        if start:
            with self._guarded():
                self._copy_prefix(reuse.source, slot, prompt_ids[:start], source_row)
        self.positions[slot] = start
        return PrefillJob(slot, list(prompt_ids), row, bitmask, generated, plan)

    def continue_prefill(self, job: PrefillJob, chunks: int, scores: list | None = None) -> PrefillJob:
        """Dispatch the job's next `chunks` chunks; the last one's sampled token becomes `job.result`.
        When `scores` is a list, score too and append (scores, length) per chunk."""
        ids, generated, out = job.prompt_ids, job.generated, None
        with self._guarded():
            for start, end, bucket, attend_len in job.chunks[job.done : job.done + chunks]:
                piece = ids[start:end]
                if scores is None:
                    made = len(ids) - generated - start if generated else None
                    out = self._prefill_chunk(job.slot, piece, attend_len, bucket, job.row, None, job.bitmask, made)
                else:
                    following = ids[start + 1 : start + 1 + len(piece)]
                    out, scored = self._prefill_chunk(
                        job.slot, piece, attend_len, bucket, job.row, following, job.bitmask
                    )
                    scores.append((scored, len(piece)))
                self.positions[job.slot] = end
        done = min(job.done + chunks, len(job.chunks))
        if done == len(job.chunks):  # its full blocks become findable (paged_slots.py; a scoring prefill's: "on" only)
            self._cache_prompt(job.slot, ids, exact=scores is None)
        return job._replace(done=done, result=PendingTokens(out) if done == len(job.chunks) else None)

    def rechunk(self, job: PrefillJob, size: int) -> PrefillJob:
        """The job's chunks still to run, planned at `size` tokens (a bucket in `chunk_sizes`: its
        programs are warm); the fixed chunks of the exact mode stay as they are."""
        return job if self.prefill_chunk else rechunk(job, self.prefill_buckets, self._window, size)

    @contextlib.contextmanager
    def _guarded(self):
        """A failure after some device work leaves the slot holding part of the prompt, which is harmless
        (it stays free, and a prefill into a slot always starts it afresh) unless the failing call had
        already consumed the donated state of every slot: then DecodeStateLost."""
        try:
            yield
        except Exception as e:
            if any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(self.state)):
                raise DecodeStateLost(f"prefill failed after donating the decode state: {e!r}") from e
            raise

    def _prefill(
        self, slot, prompt_ids, settings, scores: list | None, reuse=None, bitmask=None, generated: int = 0
    ) -> PendingTokens:
        """Prefill every chunk now; when `scores` is a list, score too and append (scores, length) per chunk."""
        job = self.start_prefill(slot, prompt_ids, settings, reuse, bitmask, generated)
        return self.continue_prefill(job, len(job.chunks), scores).result
