"""XLA options for an engine's programs: on a CPU, a bfloat16 KV memory written without widening.

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

import jax
import jax.numpy as jnp

DISABLE = "xla_disable_hlo_passes"
BF16_NORMALIZATION = "float-normalization-bf16"  # FloatNormalization's name for bfloat16


def _has_bf16(tree) -> bool:
    return any(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, "dtype"))


def compiler_options(params, state) -> dict[str, str]:
    """The options every program of an engine with these params and decode state (arrays or their
    abstract values) compiles with: none unless on a CPU with a bfloat16 state and no bfloat16 param."""
    if jax.default_backend() != "cpu" or _has_bf16(params) or not _has_bf16(state):
        return {}
    return {DISABLE: BF16_NORMALIZATION}
