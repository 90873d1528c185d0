"""`--speculative ngram|off` and `--num-speculative-tokens K` for serve, generate and sample."""

from __future__ import annotations

from hkserve.engine.engine import Engine
from hkserve.engine.spec_policy import MODES, SpecConfig
from hkserve.engine.speculative import SpeculativeEngine


def add_arguments(p) -> None:
    p.add_argument(
        "--speculative",
        default="off",
        choices=MODES,
        help="ngram: draft from earlier text of each request (prompt lookup) and verify the drafts in one step",
    )
    p.add_argument("--num-speculative-tokens", type=int, default=SpecConfig.k, help="drafts per verify step (K)")


def wrap(engine: Engine, mode: str, k: int, hosts=None) -> Engine | SpeculativeEngine:
    """The engine, speculating when `mode` (--speculative) asks, with `k` drafts per verify step.
    Refused where it cannot run: across hosts (the followers replay the plain Engine's calls), on a VQ
    memory (SpeculativeEngine refuses it)."""
    if mode == "off":
        return engine
    if hosts is not None:
        raise ValueError("--speculative ngram is not supported across hosts")
    return SpeculativeEngine(engine, SpecConfig(k=k))
