"""The runner's side of batched prefill: group the prompts admitted in one iteration by the rows
program that takes them (Engine.rows_program), so each program call fills as many rows as possible.

Whether a request is grouped depends on itself only (its prompt length, whether its prompt is
scored), never on the others waiting: that, with the fixed rows per program, keeps batch invariance.
"""

from __future__ import annotations

from hkserve.engine.outputs import PendingTokens, Token


class RowGroups:
    """Admitted (slot, stream) pairs waiting for their rows program, by bucket."""

    def __init__(self, engine, enabled: bool = True):
        self.engine, self.enabled = engine, enabled
        self._groups: dict[int, list] = {}  # bucket → [(slot, stream)], fewer than its rows

    def takes(self, request) -> bool:
        """Unscored, unconstrained prompts that fit a rows program (a grammar's first mask is a one-row prefill)."""
        plain = self.enabled and request.prompt_logprobs is None and request.grammar is None
        return plain and self.engine.rows_program(len(request.prompt_ids)) is not None

    def add(self, slot: int, stream) -> list | None:
        """Queue a request that `takes`; its bucket's group when that is now full (and no longer queued)."""
        bucket, rows = self.engine.rows_program(len(stream.request.prompt_ids))
        group = self._groups.setdefault(bucket, [])
        group.append((slot, stream))
        return self._groups.pop(bucket) if len(group) == rows else None

    def drain(self) -> list[list]:
        """The groups not yet full, in order of bucket; none are queued after."""
        groups = [self._groups[b] for b in sorted(self._groups)]
        self._groups = {}
        return groups


class RowOf:
    """Row `row` of a batched prefill's pending tokens, read as the one-row result of a prefill."""

    def __init__(self, pending: PendingTokens, row: int):
        self.pending, self.row = pending, row

    def read(self) -> list[Token]:
        return [self.pending.read()[self.row]]
