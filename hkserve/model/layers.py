"""Decoder building blocks as Haiku modules: linear maps (float, bf16 or int8), embeddings, RMSNorm,
the gated MLP (SwiGLU / GeGLU) and MoE. Attention and RoPE are in attention.py.

Parameter names follow one scheme (`q_proj/w`, `mlp/gate_proj/w`, ...) that the checkpoint importers
target; linear weights are stored [in, out].
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp

from hkserve.kernels import dispatch, ffi, pack, pack4, q4ffi
from hkserve.model import int4_pallas, layer_weights
from hkserve.model.config import ModelConfig
from hkserve.model.int4 import GROUP, Int4Weight, Int5Sym, Int8Group, Int8Sym, grouped_dot

F32 = jnp.float32
INT4 = "int4"  # the param_dtype of int4 models' linear weights: Int4Weight params w, scale, min
INT8G = "int8g"  # ... of those of their config.int8_linears: Int8Group params w (8-bit q), scale, min
INT8S = "int8s"  # ... of their config.int8_sym_linears: Int8Sym params w (int8 q), scale (float16)
INT5S = "int5s"  # ... of their config.int5_linears: Int5Sym params w (nibbles), high (bit 4), scale (float16)


def param_dtype(config: ModelConfig, name: str | None = None):
    """Storage dtype of weight matrices (norm scales stay float32 for int8 weights); `name`: the linear
    module's, which an int4 model may keep in 8-bit or 5-bit groups (config.int8_linears, int8_sym_linears,
    int5_linears)."""
    if name is not None and name in config.int8_linears:
        return INT8G
    if name is not None and name in config.int8_sym_linears:
        return INT8S
    if name is not None and name in config.int5_linears:
        return INT5S
    return {"bfloat16": jnp.bfloat16, "int8": jnp.int8, "int4": INT4}.get(config.dtype, F32)


def norm_dtype(config: ModelConfig):
    return jnp.bfloat16 if config.dtype == "bfloat16" else F32


def quantized_weight(name: str, shape, dtype, scale_shape, fan_in: int):
    """(weight, per-output-channel scale or None). int8 weights (grok-1's QuantizedWeight8bit idea)
    are widened inside the jitted dot, which XLA fuses: the step reads int8 bytes, never a float copy.
    With CPU kernels active (kernels/dispatch.py) a 2-D int8 weight is read in its packed uint8
    layout, which the model's `prepare` made at load."""
    if dtype == jnp.int8 and len(shape) == 2 and dispatch.matmuls() is not None:
        w = hk.get_parameter(name, pack.packed_shape(tuple(shape)), jnp.uint8, init=jnp.zeros)
    else:
        w = hk.get_parameter(name, shape, dtype, init=_init(fan_in) if dtype != jnp.int8 else jnp.zeros)
    if dtype != jnp.int8:
        return w, None
    return w, hk.get_parameter(f"{name}_scale" if name != "w" else "scale", scale_shape, F32, init=jnp.ones)


WIDE_OUT = 16384  # int8 products with at least this many outputs (vocabulary heads) go block by block
_BLOCK = 4096


def _wide_int8_dot(x: jax.Array, w: jax.Array, out_axis: int) -> jax.Array | None:
    """x·w for an int8 w whose output dim is large, in blocks of <= 4096 outputs.

    XLA's CPU dot with the int8→f32 convert fused runs ~4x slower than float32 on a [576, 49152]
    head at 16 rows, but fast on blocks; None when the output dim has no suitable block size."""
    out = w.shape[out_axis]
    n = next((k for k in range(-(-out // _BLOCK), out // 512 + 1) if out % k == 0), None)
    if n is None:
        return None
    size = out // n
    flat = x.reshape(-1, x.shape[-1]).astype(F32)

    def block(i):
        part = jax.lax.dynamic_slice_in_dim(w, i * size, size, axis=out_axis).astype(F32)
        return flat @ (part.T if out_axis == 0 else part)  # [rows, size]

    y = jax.lax.map(block, jnp.arange(n))  # [n, rows, size]
    return y.transpose(1, 0, 2).reshape(*x.shape[:-1], out)


def qdot(x: jax.Array, w: jax.Array, scale: jax.Array | None, spec: str | None = None, out_axis: int = 1) -> jax.Array:
    """x·w accumulated in float32; int8 weights widen in the dot and their scale applies after it.
    A packed (uint8) weight goes to the active CPU kernel, which applies the scale itself."""
    if w.dtype == jnp.uint8:
        kernel = dispatch.matmuls()
        return ffi.matmul(x, w, scale, kernel.kind, kernel.isa, kernel.threads)
    if scale is None:
        x = x.astype(w.dtype)
        if out_axis == 0:
            w = w.T
        return jnp.einsum(spec, x, w, preferred_element_type=F32) if spec else jnp.dot(x, w, preferred_element_type=F32)
    if spec is None and w.ndim == 2 and w.shape[out_axis] >= WIDE_OUT:
        y = _wide_int8_dot(x, w, out_axis)
        if y is not None:
            return y * scale
    if out_axis == 0:
        w = w.T
    w = w.astype(F32)
    y = jnp.einsum(spec, x.astype(F32), w) if spec else jnp.dot(x.astype(F32), w)
    return y * scale


def _init(fan_in: int):
    return hk.initializers.TruncatedNormal(stddev=fan_in**-0.5)


class Linear(hk.Module):
    """y = x @ w (+ b); accumulates in float32 whatever the storage dtype. The bias, if any, is stored
    in `bias_dtype` (float32 next to int8 weights)."""

    def __init__(self, out_dim: int, dtype, name: str, bias_dtype=None):
        super().__init__(name=name)
        self.out_dim = out_dim
        self.dtype = dtype
        self.bias_dtype = bias_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        held = layer_weights.held(hk.experimental.current_name())
        if held is not None:  # kernel mode inside the layer stack: the kernel reads its layer in place
            y = held.matmul(x, self.out_dim)
        elif self.dtype == INT4:
            y = _int4_linear(x, self.out_dim)
        elif self.dtype == INT5S:
            y = _int5_linear(x, self.out_dim)
        elif self.dtype in (INT8G, INT8S):
            y = _int8_group_linear(x, self.out_dim, signed=self.dtype == INT8S)
        else:
            w, scale = quantized_weight("w", [x.shape[-1], self.out_dim], self.dtype, [self.out_dim], x.shape[-1])
            y = qdot(x, w, scale)
        if self.bias_dtype is not None:
            y = y + hk.get_parameter("b", [self.out_dim], self.bias_dtype, init=jnp.zeros).astype(F32)
        return y


def _int8_group_linear(x: jax.Array, out_dim: int, signed: bool) -> jax.Array:
    """x · an Int8Group [K, out_dim] (K padded to whole groups; `signed`: an Int8Sym, int8 q and a float16
    scale, no min): hk_w8ga16 (hk_w8sa16) with the CPU kernels, else dequantized in the dot (XLA)."""
    groups = -(-x.shape[-1] // GROUP)
    kernel = dispatch.matmuls()
    names, dtype = ("scale",) if signed else ("scale", "min"), jnp.float16 if signed else F32
    if kernel is not None:  # CPU kernels: the layout `prepare` packed (kernels/pack4.pack8, pack8_sym)
        wshape, sshape = pack4.packed_shapes8((groups * GROUP, out_dim))
        w = hk.get_parameter("w", wshape, jnp.uint8, init=jnp.zeros)
        scale, *low = (hk.get_parameter(n, sshape, dtype, init=jnp.zeros) for n in names)
        if signed:
            return q4ffi.matmul_int8_sym(x, w, scale, out_dim, kernel.isa, kernel.threads)
        return q4ffi.matmul_int4(x, w, scale, *low, out_dim, q4ffi.EIGHT_BIT, kernel.isa, kernel.threads)
    q = hk.get_parameter("w", [groups * GROUP, out_dim], jnp.int8 if signed else jnp.uint8, init=jnp.zeros)
    parts = (hk.get_parameter(n, [groups, out_dim], dtype, init=jnp.ones if n == "scale" else jnp.zeros) for n in names)
    return grouped_dot(x, (Int8Sym if signed else Int8Group)(q, *parts))


def _int5_linear(x: jax.Array, out_dim: int) -> jax.Array:
    """x · an Int5Sym [K, out_dim] (K padded to whole groups): the spec's 5-bit kernel (hk_w5sa16 or
    hk_w5sa8) with the CPU kernels, else dequantized in the dot (XLA)."""
    groups = -(-x.shape[-1] // GROUP)
    kernel = dispatch.matmuls()
    if kernel is not None:  # CPU kernels: the layout `prepare` packed (kernels/pack4.pack5)
        wshape, hshape, sshape = pack4.packed_shapes5((groups * GROUP // 2, out_dim))
        w = hk.get_parameter("w", wshape, jnp.uint8, init=jnp.zeros)
        high = hk.get_parameter("high", hshape, jnp.uint8, init=jnp.zeros)
        scale = hk.get_parameter("scale", sshape, jnp.float16, init=jnp.zeros)
        return q4ffi.matmul_int5_sym(x, w, high, scale, out_dim, kernel.isa, kernel.threads, kind=kernel.int5)
    w = hk.get_parameter("w", [groups * GROUP // 2, out_dim], jnp.uint8, init=jnp.zeros)
    high = hk.get_parameter("high", [groups * GROUP // 8, out_dim], jnp.uint8, init=jnp.zeros)
    scale = hk.get_parameter("scale", [groups, out_dim], jnp.float16, init=jnp.ones)
    return grouped_dot(x, Int5Sym(w, high, scale))


def _int4_linear(x: jax.Array, out_dim: int) -> jax.Array:
    """x · an Int4Weight [K, out_dim] (K padded to whole groups): the spec's int4 kernel (hk_w4a16 or
    hk_w4a8) with the CPU kernels, else the Pallas kernel where HKSERVE_INT4_MATMUL asks for it
    (int4_pallas.py), else dequantized in the dot (XLA)."""
    groups = -(-x.shape[-1] // GROUP)
    kernel = dispatch.matmuls()
    if kernel is not None:  # CPU kernels: the layout `prepare` packed (kernels/pack4.py)
        wshape, sshape = pack4.packed_shapes((groups * GROUP // 2, out_dim))
        w = hk.get_parameter("w", wshape, jnp.uint8, init=jnp.zeros)
        scale, low = (hk.get_parameter(n, sshape, F32, init=jnp.zeros) for n in ("scale", "min"))
        return q4ffi.matmul_int4(x, w, scale, low, out_dim, kernel.int4, kernel.isa, kernel.threads)
    w = hk.get_parameter("w", [groups * GROUP // 2, out_dim], jnp.uint8, init=jnp.zeros)
    scale = hk.get_parameter("scale", [groups, out_dim], F32, init=jnp.ones)
    low = hk.get_parameter("min", [groups, out_dim], F32, init=jnp.zeros)
    mode = int4_pallas.kernel_choice(w.shape)
    if mode is not None:  # the Pallas kernel: bf16 operands on a GPU, float32 interpreted (the tests)
        return int4_pallas.int4_matmul(
            x, w, scale, low, dtype=jnp.bfloat16 if mode == "pallas" else F32, interpret=mode == "interpret"
        )
    return grouped_dot(x, Int4Weight(w, scale, low))


class Embed(hk.Module):
    """Token embeddings [V, D]; also the output head when embeddings are tied. int4 models keep their
    embeddings int8 (per-row scales): a lookup reads one row, and the tied head runs as int8."""

    def __init__(self, vocab_size: int, dim: int, dtype, name: str = "embed"):
        super().__init__(name=name)
        self.shape = (vocab_size, dim)
        self.dtype = jnp.int8 if dtype == INT4 else dtype

    def _table(self):
        """[V, D] embeddings and, for int8, a scale per token row [V] (= per output channel when tied)."""
        if self.dtype == jnp.int8 and dispatch.matmuls() is not None:  # packed as the [D, V] output head
            table = hk.get_parameter("embeddings", pack.packed_shape(self.shape[::-1]), jnp.uint8, init=jnp.zeros)
            return table, hk.get_parameter("scale", self.shape[:1], F32, init=jnp.ones)
        if self.dtype == jnp.int8:
            table = hk.get_parameter("embeddings", self.shape, jnp.int8, init=jnp.zeros)
            return table, hk.get_parameter("scale", self.shape[:1], F32, init=jnp.ones)
        return hk.get_parameter("embeddings", self.shape, self.dtype, init=hk.initializers.TruncatedNormal(1.0)), None

    def __call__(self, tokens: jax.Array) -> jax.Array:
        table, scale = self._table()
        if table.dtype == jnp.uint8:
            rows = pack.unpack_rows(table, tokens, self.shape[1]).astype(F32)
        else:
            rows = jnp.take(table, tokens, axis=0).astype(F32)
        return rows if scale is None else rows * jnp.take(scale, tokens)[..., None]

    def unembed(self, x: jax.Array) -> jax.Array:
        table, scale = self._table()
        return qdot(x, table, scale, out_axis=0)


class RMSNorm(hk.Module):
    """x / rms(x) * (offset + scale) in float32; offset 1 is Gemma's form (it stores scale - 1)."""

    def __init__(self, eps: float, dtype, name: str, offset: float = 0.0):
        super().__init__(name=name)
        self.eps = eps
        self.dtype = dtype
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = hk.get_parameter("scale", [x.shape[-1]], self.dtype, init=jnp.ones)
        x = x.astype(F32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return x * (self.offset + scale.astype(F32))


_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
}


class MLP(hk.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); act silu (SwiGLU) or tanh-approximated gelu (GeGLU)."""

    def __init__(self, config: ModelConfig, name: str = "mlp"):
        super().__init__(name=name)
        self.c = config

    def __call__(self, x):
        c = self.c
        gate_up = layer_weights.fused("gate_up_proj", (c.ffn_dim,) * 2, x)  # CPU kernels: one call
        gate, up = gate_up or (Linear(c.ffn_dim, param_dtype(c, n), n)(x) for n in ("gate_proj", "up_proj"))
        return Linear(c.dim, param_dtype(c, "down_proj"), "down_proj")(_ACTIVATIONS[c.mlp_activation](gate) * up)


class MoE(hk.Module):
    """Top-k mixture of gated experts: act(x @ gate) * (x @ up) @ down per expert.

    Routing "mixtral": gates = softmax over the k selected router logits. Routing "grok": softmax over
    all experts, top-k, gates not renormalised. Unless `moe_dense`, experts no token selected are
    skipped (lax.cond in a scan over experts), so a decode step reads only the used experts' weights —
    with few tokens in flight that is k of E experts; grok-1's released code runs all of them. With
    `shared_expert_dim`, a gated MLP every token uses is added (Qwen2-MoE's shared expert). With
    `moe_biases` (gpt-oss) the router and every expert product add a bias.
    """

    def __init__(self, config: ModelConfig, name: str = "moe"):
        super().__init__(name=name)
        self.c = config

    def __call__(self, x):
        c = self.c
        dtype = param_dtype(c)
        e, d, f = c.n_experts, c.dim, c.ffn_dim
        bias = norm_dtype(c) if c.moe_biases else None
        router_logits = Linear(e, dtype, "router", bias_dtype=bias)(x)  # [B, T, E]
        if c.moe_routing == "grok":
            top_gates, top_idx = jax.lax.top_k(jax.nn.softmax(router_logits, axis=-1), c.n_experts_per_token)
        else:
            top_logits, top_idx = jax.lax.top_k(router_logits, c.n_experts_per_token)  # [B, T, K]
            top_gates = jax.nn.softmax(top_logits, axis=-1)
        gates = jnp.sum(jax.nn.one_hot(top_idx, e, dtype=F32) * top_gates[..., None], axis=-2)  # [B, T, E]
        w_gate, s_gate = quantized_weight("gate_proj", [e, d, f], dtype, [e, f], d)
        w_up, s_up = quantized_weight("up_proj", [e, d, f], dtype, [e, f], d)
        w_down, s_down = quantized_weight("down_proj", [e, f, d], dtype, [e, d], f)
        biases = _expert_biases(c) if c.moe_biases else (0.0, 0.0, 0.0)  # [E, F], [E, F], [E, D]

        def expert(i):
            def pick(w, s):
                return w[i], None if s is None else s[i]

            def at(b):
                return b if isinstance(b, float) else b[i]

            gate = qdot(x, *pick(w_gate, s_gate)) + at(biases[0])
            h = _glu(c, gate, qdot(x, *pick(w_up, s_up)) + at(biases[1]))
            return qdot(h, *pick(w_down, s_down)) + at(biases[2])  # [B, T, D]

        if c.moe_dense:
            y = jax.vmap(expert, out_axes=2)(jnp.arange(e))  # [B, T, E, D]
            return jnp.einsum("bted,bte->btd", y, gates) + _shared_expert(c, x)

        def add_expert(acc, i):
            gate = gates[..., i]  # [B, T]
            out = jax.lax.cond(jnp.any(gate > 0), lambda: expert(i) * gate[..., None], lambda: jnp.zeros_like(acc))
            return acc + out, None

        return jax.lax.scan(add_expert, jnp.zeros(x.shape[:-1] + (d,), F32), jnp.arange(e))[0] + _shared_expert(c, x)


def _glu(c: ModelConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
    """An expert's gated unit: act(gate) * up, or gpt-oss's clamped SwiGLU, whose clamps keep the
    activations of its large checkpoints in range: gate <= limit, |up| <= limit, and a +1 on up."""
    if c.moe_activation != "clamped_swiglu":
        return _ACTIVATIONS[c.moe_activation](gate) * up
    gate = jnp.minimum(gate, c.swiglu_limit)
    up = jnp.clip(up, -c.swiglu_limit, c.swiglu_limit)
    return (up + 1.0) * gate * jax.nn.sigmoid(c.swiglu_alpha * gate)


def _expert_biases(c: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """gpt-oss's per-expert biases of the gate [E, F], up [E, F] and down [E, D] products (at moe/)."""
    shapes = {"gate_bias": c.ffn_dim, "up_bias": c.ffn_dim, "down_bias": c.dim}
    return tuple(
        hk.get_parameter(n, [c.n_experts, w], norm_dtype(c), init=jnp.zeros).astype(F32) for n, w in shapes.items()
    )


def _shared_expert(c: ModelConfig, x: jax.Array) -> jax.Array | float:
    """The shared expert every token goes through (Qwen2-MoE), scaled by its own sigmoid gate; 0 without.
    A function, not a method, so its params sit at moe/shared_expert and moe/shared_gate."""
    if not c.shared_expert_dim:
        return 0.0
    shared = MLP(c.replace(ffn_dim=c.shared_expert_dim, mlp_activation=c.moe_activation), name="shared_expert")
    gate = jax.nn.sigmoid(Linear(1, param_dtype(c), "shared_gate")(x))  # [B, T, 1]
    return shared(x) * gate
