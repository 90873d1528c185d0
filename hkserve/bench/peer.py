"""The peer of `bench engine`: Hugging Face transformers greedy decoding with its KV cache, on our weights,
in our dtype (float32 | bfloat16), on the same kind of device (CUDA when JAX runs on a GPU).

torch and transformers are optional (the `bench` extra): every function imports them itself, so they
stay out of hkserve's import path.
"""

from __future__ import annotations

import inspect
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from hkserve.checkpoint.hf_write import hf_checkpoint_tensors, hf_config_dict, hf_writable
from hkserve.model.build import build_model
from hkserve.model.memory import init_memory

WARMUP_STEPS = 2
# Largest |logit difference| to our forward pass, relative to the largest |logit|, for the peer to count
# as running the same model. Both sides compute it in float32 (bfloat16 weights cast up exactly), where
# they agree to ~5e-6 on SmolLM2 and a wrong layout is off by ~1. In bfloat16 itself rounding alone
# reached 2e-2 to 1.1e-1 on SmolLM2 (three prompts), so no bfloat16 threshold separates the two.
LOGIT_TOLERANCE = 1e-4
PEER_DTYPES = ("float32", "bfloat16")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def peer_device() -> str:
    """cuda where JAX runs on a GPU (and torch sees one), else cpu."""
    import torch  # optional dependency, see the module docstring

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def _to_torch(array: np.ndarray, device: str):
    import torch

    array = np.require(array, requirements="W")  # torch wants writable memory: copies the read-only views
    if array.dtype.name == "bfloat16":  # numpy has no bfloat16 of its own: move the bits
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(array).to(device)


def load_hf_peer(config, params, device: str):
    """The transformers model (LlamaForCausalLM, MixtralForCausalLM for MoE) built from our config on
    `device` in our dtype, its weights copied from `params` (no checkpoint file, no float32 detour);
    every tensor name must match, so a wrong conversion fails here rather than in the logits."""
    import torch
    import transformers

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
    fields = hf_config_dict(config)
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    state = {name: _to_torch(t, device) for name, t in hf_checkpoint_tensors(config, params).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"peer weights do not match: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    return model.eval()


def peer_logits_error(hf_model, model, params, prompt: np.ndarray) -> float:
    """Max |logit difference| between the peer and our forward pass on one prompt [T], relative to our
    largest |logit|."""
    import torch

    ids = np.asarray(prompt, np.int32)[None]
    memory = init_memory(model.config, 1, ids.shape[1])
    ours, _ = jax.jit(model.forward)(params, ids, memory, np.asarray([ids.shape[1]], np.int32))
    ours = np.asarray(ours, np.float32)
    device = next(hf_model.parameters()).device
    with torch.inference_mode():
        theirs = hf_model(input_ids=torch.from_numpy(ids.astype(np.int64)).to(device)).logits.float().cpu().numpy()
    return float(np.max(np.abs(ours - theirs)) / max(np.max(np.abs(ours)), 1e-30))


def layout_error(config, params, prompt: np.ndarray, device: str) -> float:
    """`peer_logits_error` of the peer built from our weights, both sides in float32 at full matmul
    precision (a GPU's default for float32 is TF32) whatever dtype is benchmarked: see LOGIT_TOLERANCE."""
    config32 = config.replace(dtype="float32")
    params32 = jax.tree.map(lambda a: a.astype(np.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
    hf_model = load_hf_peer(config32, params32, device)
    with jax.default_matmul_precision("highest"):
        return peer_logits_error(hf_model, build_model(config32), params32, prompt)


def bench_hf(hf_model, prompts: np.ndarray, steps: int, repeats: int) -> float:
    """Greedy decode tok/s of the peer at batch len(prompts): a manual loop over its KV cache, so
    only decode steps are timed, not prefill or generate()'s bookkeeping."""
    import torch

    device = next(hf_model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    # transformers 5.2x renamed `past_key_values` to `cache` (argument and output); accept either.
    key = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    batch, prompt_len = prompts.shape
    times = []
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            out = hf_model(input_ids=torch.from_numpy(prompts.astype(np.int64)).to(device), use_cache=True)
            for i in range(WARMUP_STEPS + steps):
                if i == WARMUP_STEPS:
                    sync()
                    start = time.perf_counter()
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                out = hf_model(input_ids=token, use_cache=True, **{key: out[key]})
            token = out.logits[:, -1].argmax(-1).cpu()  # the last step's tokens on the host, as hkserve reads them
            if repeat:
                times.append(time.perf_counter() - start)
            cached = out[key].get_seq_length()
            if cached != prompt_len + WARMUP_STEPS + steps:
                raise RuntimeError(
                    f"the peer's KV cache holds {cached} positions, expected "
                    f"{prompt_len + WARMUP_STEPS + steps}: it is not decoding incrementally"
                )
    return batch * steps / statistics.median(times)


def run_peer(config, params, prompts: np.ndarray, batches: list[int], steps: int, repeats: int):
    """({batch: tok/s} or None with the reason on stderr, {versions and settings of the peer})."""
    try:
        import torch
        import transformers
    except ImportError as e:
        _log(f"peer skipped: torch/transformers not importable ({e}); `pip install -e '.[bench]'`")
        return None, {}
    if config.dtype not in PEER_DTYPES:
        _log(f"peer skipped: it runs float weights, not {config.dtype}")
        return None, {}
    if not hf_writable(config):
        _log("peer skipped: the model's family options have no transformers layout here (Llama/Mixtral only)")
        return None, {}
    device = peer_device()
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "peer_device": device,
        "peer_dtype": config.dtype,
    }
    _log(
        f"peer: transformers {transformers.__version__}, torch {torch.__version__} on {device} in {config.dtype} "
        f"({torch.get_num_threads()} CPU threads, torch's default)"
    )
    error = layout_error(config, params, prompts[0, :16], device)
    versions["peer_logit_error"] = error
    _log(f"peer: max |logit difference| vs hkserve in float32 = {error:.2e} of the largest |logit|")
    if not error <= LOGIT_TOLERANCE:
        _log(
            f"WARNING: the peer's logits differ from ours by {error:.2e} (> {LOGIT_TOLERANCE}): "
            f"weight conversion is wrong; peer skipped"
        )
        return None, versions
    hf_model = load_hf_peer(config, params, device)
    results = {}
    for batch in batches:
        _log(f"peer: batch {batch} ...")
        start = time.perf_counter()
        results[batch] = bench_hf(hf_model, prompts[:batch], steps, repeats)
        _log(f"peer: batch {batch}: {results[batch]:.1f} tok/s ({time.perf_counter() - start:.0f} s)")
    return results, versions
