"""Which matrix-product path a model runs: `--kernels auto | w8a32 | w8a16 | w8a8 | w4a16 | w4a8 | xla` → a
KernelSpec or None (XLA's dots).

auto is w8a16: int8 weights times activations quantized per row to int16 in blocks of 128
(vpdpwssd: twice the multiply-adds per instruction of float32 FMAs), whose perplexity is the
weight-only kernel's to 4 digits (SmolLM2 on the Genesis excerpt 4.4835 vs w8a32's 4.4836, float32
4.4475) and which is the faster at every batch (kernels/README.md). w8a32 keeps the activations
float32 (the quality of XLA's int8 path); w8a8 quantizes them to int8 per 32 values (llama.cpp's
Q8_0), whose perplexity on that short excerpt swings by 1-3% with the last bits of its inputs.

int4 weights run hk_w4a8 (int8 activations per 32: vpdpbusd's 64 products an instruction, half of
hk_w4a16's instructions at 16 rows) under auto, w8a8 and w4a8, and hk_w4a16 (int16 per 128) under w4a16,
w8a16 and w8a32. On 7.6k tokens of English prose hk_w4a8 stays within 1% of float32 (SmolLM2 Q4_1 +0.34%,
hk_w4a16 +0.08%); on the 103-token Genesis excerpt it swings (-1.60% at window 512), which is why w4a16
stays selectable (kernels/README.md has the tables). Signed 5-bit groups (Gemma's Q5_0 stacks) follow the
int4 choice: hk_w5sa8 (int8 per 32) where int4 runs hk_w4a8, else hk_w5sa16 (int16 per 128). One kernel
per model: a row's bits do not depend on the batch.

Float32/bfloat16 weights get a spec too, with no matrix-product kind (`kind` None, `attention_only`):
their products stay XLA's dots, and only a decode step's attention runs the C++ kernel, which reads
each row's KV memory (static, or paged by its block table) in place up to that row's own length
instead of XLA's copy of every row's window up to the longest row's (issue 34).

The decoder reads the active spec while it is traced (`using(spec)`), so one model function serves
both paths and the choice is made once, where the model is built.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from typing import NamedTuple

import jax

from hkserve.kernels import contention, ffi

log = logging.getLogger("hkserve.kernels")
CHOICES = ("auto", "w8a32", "w8a16", "w8a8", "w4a16", "w4a8", "xla")


class KernelSpec(NamedTuple):
    kind: str | None  # int8 weights x activations: "w8a16" int16 per 128 values | "w8a8" int8 per 32 | "w8a32"
    # float32 | None: float weights, whose products stay XLA's (decode attention only)
    isa: int  # 2 AVX-512 VNNI | 1 AVX2
    threads: int = 0  # 0: XLA's intra-op pool, capped while other processes hold cores (contention.py);
    # HKSERVE_KERNEL_THREADS=N fixes N (1: the calling thread only)
    int4: str = "w4a8"  # int4 weights x activations: "w4a8" int8 per 32 values | "w4a16" int16 per 128

    @property
    def int5(self) -> str:
        """The signed 5-bit groups' kernel: hk_w5sa8 (int8 activations per 32) where the int4 kernel takes
        int8 activations (hk_w4a8), else hk_w5sa16 (int16 per 128)."""
        return "w5sa8" if self.int4 == "w4a8" else "w5sa16"

    @property
    def attention_only(self) -> bool:
        """A float model's spec: decode attention in place, nothing else (products, sampler) on the kernels."""
        return self.kind is None

    def describe(self) -> str:
        what = "decode attention only (float weights)"
        if not self.attention_only:
            what = f"{self.kind} (int4: {self.int4}, int5: {self.int5})"
        return f"{what} on {ffi.ISA_NAMES[self.isa]}, {self.threads or 'auto'} threads"


_ACTIVE: contextvars.ContextVar[KernelSpec | None] = contextvars.ContextVar("hkserve_kernels", default=None)


def active() -> KernelSpec | None:
    """The spec being traced: decode attention reads the KV memory in place under any spec."""
    return _ACTIVE.get()


def matmuls() -> KernelSpec | None:
    """The spec being traced where it runs the quantized products (packed int8/int4 weights), else None."""
    spec = _ACTIVE.get()
    return None if spec is None or spec.attention_only else spec


@contextlib.contextmanager
def using(spec: KernelSpec | None):
    token = _ACTIVE.set(spec)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def add_kernels_argument(p) -> None:
    """--kernels on every command that runs a model."""
    p.add_argument(
        "--kernels",
        default="auto",
        choices=list(CHOICES),
        help="auto = the C++ CPU kernels where they apply (CPU, 1x1 mesh): int8 matrix products with "
        "activations quantized to int16 per 128 values (w8a16; float32's perplexity to 4 digits), and decode "
        "attention reading the KV memory in place (float weights too: their products stay XLA's); "
        "w8a32 = float32 activations; w8a8 = int8 activations per 32 values (llama.cpp's Q8_0); xla = XLA's "
        "dots. int4 weights run w4a8 (int8 activations per 32) except with w8a32, w8a16 or w4a16 (int16 "
        "activations per 128), 5-bit groups alike (hk_w5sa8 / hk_w5sa16); w4a16/w4a8 name the int4 kernel and "
        "keep w8a16",
    )


INT4_KINDS = ("w4a16", "w4a8")  # name the int4 kernel; the int8 weights (embeddings) then run w8a16

ISA_ENV = "HKSERVE_KERNEL_ISA"  # "avx2": the AVX2 paths on an AVX-512 machine too (to test and measure them)


def machine_isa() -> int:
    """The ISA path the kernels run: this CPU's best, or AVX2 where HKSERVE_KERNEL_ISA=avx2 asks for it."""
    isa, forced = ffi.cpu_isa(), os.environ.get(ISA_ENV, "")
    if forced not in ("", *ffi.ISA_NAMES.values()):
        raise ValueError(f"{ISA_ENV} must be one of {sorted(ffi.ISA_NAMES.values())}, got {forced!r}")
    wanted = {name: level for level, name in ffi.ISA_NAMES.items()}.get(forced, isa)
    return min(isa, wanted)


def resolve(requested: str, dtype: str, memory: str = "kv", devices: int = 1) -> KernelSpec | None:
    """The kernels for a model, or None for XLA. "auto" (w8a16) and the named kinds take them for KV-memory
    models on a single CPU device when this CPU runs an ISA path and the library builds (else they log
    why not). int8 weights run their products on the spec's kind; int4 models the spec's int4 kernel for
    their int4 linear weights, its kind for their int8 embeddings (and tied head); float32/bfloat16 ones
    get an attention-only spec (kind None): XLA's dots, the kernel's decode attention."""
    if requested not in CHOICES:
        raise ValueError(f"--kernels must be one of {CHOICES}, got {requested!r}")
    if requested == "xla" or memory != "kv":
        return None
    if jax.default_backend() != "cpu":
        return None  # GPU/TPU keep XLA's dots (and the paged Pallas kernel or XLA's attention)
    if devices != 1:
        log.warning("kernels: a %d-device mesh runs XLA's dots and attention (the kernels run on a 1x1 mesh)", devices)
        return None
    isa = machine_isa()
    if isa == 0:
        log.warning("kernels: this CPU has neither AVX-512 VNNI nor AVX2 (or no library): using XLA")
        return None
    quantized = dtype in ("int8", "int4")
    kind = ("w8a16" if requested in ("auto", *INT4_KINDS) else requested) if quantized else None
    int4 = "w4a16" if quantized and requested in ("w8a32", "w8a16", "w4a16") else "w4a8"  # float: one spec
    spec = KernelSpec(kind, isa, int(os.environ.get("HKSERVE_KERNEL_THREADS", "0")), int4)
    if spec.threads == 0:  # the pool's threads, fewer while other processes hold cores
        contention.watch(ffi.set_thread_cap)
    log.warning("kernels: %s", spec.describe())
    return spec
