"""XLA options for an engine's programs on a CPU: the fusion emitters off, and a bfloat16 KV memory
written without widening.

XLA:CPU's fusion emitters (its newer code generator for fused elementwise, reduce and scatter ops) make
each program larger once loaded and slower to compile than its older loop emitters do: with them off a
`serve` start of SmolLM2 held 25-40 MiB less after a request and a cold one used ~27% less CPU to
compile; but its decode step at 16 slots took ~7-9% more CPU (docs/benchmarks.md, "XLA's fusion
emitters off"). An XLA_FLAGS that names the option wins (read by XLA for every compile; a per-compile
option would override it).

XLA:CPU's float-normalization pass rewrites every bfloat16 op its emitters do not take natively (the
scatter and dynamic-update-slice that write new keys and values among them) as: convert the whole
operand to float32, run the op, convert back. For the KV memory that is the whole [L, NB, bs, Hkv, Dh]
pool (static: [L, B, S, Hkv, Dh]), so every prefill, decode step and prefix copy held a float32 copy of
it as temp memory (SmolLM2, 16 x 2048 positions: 1,441 MiB per program, `temp_size_in_bytes`; RSS +1.4
GiB after the first request) and converted 720 MiB twice each step. Without the pass those writes move
bfloat16 bits as they are, in place (docs/benchmarks.md, "What the memory besides arrays is").

Only where the params hold no bfloat16: the CPU's dot emitter has no bfloat16 (the pass widens those
dots), and a program of float32 or int8/int4 (C++ kernel) weights does no bfloat16 arithmetic: its bf16
ops are the memory's reads and writes and the converts around them, the same bits either way.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

DISABLE = "xla_disable_hlo_passes"
BF16_NORMALIZATION = "float-normalization-bf16"  # FloatNormalization's name for bfloat16
FUSION_EMITTERS = "xla_cpu_use_fusion_emitters"


def _has_bf16(tree) -> bool:
    return any(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, "dtype"))


def _named_in_xla_flags(option: str) -> bool:
    return any(flag.split("=", 1)[0] == f"--{option}" for flag in os.environ.get("XLA_FLAGS", "").split())


def compiler_options(params, state) -> dict[str, str | bool]:
    """The options every program of an engine with these params and decode state (arrays or their
    abstract values) compiles with: none but on a CPU; there the fusion emitters off (unless XLA_FLAGS
    name them), and the bf16 normalization off with a bfloat16 state and no bfloat16 param."""
    if jax.default_backend() != "cpu":
        return {}
    options: dict[str, str | bool] = {} if _named_in_xla_flags(FUSION_EMITTERS) else {FUSION_EMITTERS: False}
    if _has_bf16(state) and not _has_bf16(params):
        options[DISABLE] = BF16_NORMALIZATION
    return options
