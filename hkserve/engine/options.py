"""How an Engine is built, as one frozen record (cli/loading.py makes it from the command's flags)."""

from __future__ import annotations

from dataclasses import dataclass

from hkserve.engine.kv_layout import DEFAULT_BLOCK_SIZE, DEFAULT_LAYOUT

DEFAULT_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)
# "auto": one window (max_len) where the step's attention reads each row's own length, else the windows;
# "windows" | "one" force either (both exact on every path; they differ in programs and in cost).
STEP_WINDOWS = ("auto", "windows", "one")


@dataclass(frozen=True)
class EngineOptions:
    """`structured`: also compile the step of grammar-constrained batches in warmup (servers do; else
    its programs compile on the first constrained step). `split_masks`: run that step as two programs,
    so the host fills the masks while the model half runs (the default on accelerators), or as one
    program once the masks are filled (the default on the CPU, where the host shares the cores with the
    "device" and the split costs more than the overlap gains: docs/benchmarks.md). `kv_layout` "paged":
    KV in blocks of `block_size` tokens from one pool of `kv_cache_mb` MiB (kv_layout.py; None: its
    default), given to slots as they grow (block_pool.py)."""

    slots: int = 1  # decode rows
    max_len: int = 2048  # tokens per slot (at most the model's context)
    prefill_buckets: tuple[int, ...] = DEFAULT_PREFILL_BUCKETS  # prompt lengths are padded up to one of these
    n_top: int = 5  # top logprobs per sampled token
    prefill_rows: int = 4  # short prompts prefilled together per rows program (prefill_rows.py); 0: off
    structured: bool = False
    prefix_cache: str = "off"  # prefix_cache.MODES
    split_masks: bool | None = None  # None: by backend (see above)
    kv_layout: str = DEFAULT_LAYOUT  # "paged" (the default, kv_layout.py) | "static" (slots x max_len reserved)
    kv_cache_mb: float | None = None  # paged: the pool's size (None: kv_layout.py's default)
    block_size: int = DEFAULT_BLOCK_SIZE  # paged: tokens per block
    step_windows: str = "auto"  # STEP_WINDOWS: the decode step's windows (engine.py `step_windows`)
