"""XLA options every `hkserve` command sets for GPUs before JAX starts its backend.

Command buffers with conditionals and while loops let XLA record a whole decode step (the layer loop's
kernels, the sampler's `lax.cond`) as CUDA graphs that the device runs without a host round trip per
branch. On one H200 (docs/benchmarks.md, "GPU") they took a Llama 3.2 1B decode step from 3.58 to
2.36 ms at batch 1 and from 3.31 to 2.38 ms at 64 slots with the layer loop, the outputs unchanged.
The CPU backend ignores GPU options. XLA_FLAGS that already name the option win; HKSERVE_XLA_DEFAULTS=0
leaves XLA_FLAGS as they are. Library users (an `Engine` built in their own process) set XLA_FLAGS
themselves.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
_OPTION = COMMAND_BUFFERS.split("=", 1)[0]


def with_gpu_defaults(flags: str) -> str:
    """`flags` (an XLA_FLAGS value) with the GPU defaults added where they name no setting of their own."""
    if _OPTION in flags:
        return flags
    return f"{flags} {COMMAND_BUFFERS}".strip()


def apply_gpu_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """Add the defaults to XLA_FLAGS (read when JAX starts its backend: call before any device use)."""
    if environ.get("HKSERVE_XLA_DEFAULTS", "1").strip().lower() in ("0", "off", "false", "no"):
        return
    environ["XLA_FLAGS"] = with_gpu_defaults(environ.get("XLA_FLAGS", ""))
