"""What tests share besides pytest fixtures (those stay in conftest.py): paths, the reference
fixtures (missing → the test fails, naming where it looked), the CLI in a subprocess, tiny model
configs and the grok reference reader."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from hkserve.checkpoint.grok import config_from_grok, load_grok
from hkserve.model.build import build_model
from hkserve.model.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("HKSERVE_SHARED", REPO.parent / "shared"))
FIXTURES = SHARED / "fixtures"


def require_fixtures() -> Path:
    """The reference fixtures directory. They are part of what the suite checks: absent is a failure."""
    if not FIXTURES.is_dir():
        pytest.fail(f"reference fixtures not found at {FIXTURES} (set HKSERVE_SHARED to the folder holding fixtures/)")
    return FIXTURES


def hkserve(
    *args: str, home: Path, check: bool = True, timeout: float = 900, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess with its own model store (and `env` added to the environment)."""
    env = {**os.environ, "HKSERVE_HOME": str(home), **(env or {})}
    result = subprocess.run(
        [sys.executable, "-m", "hkserve.cli.main", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode:
        raise AssertionError(f"hkserve {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


def tiny_config(**changes: Any) -> ModelConfig:
    """A small random-weight config: GQA (4 query / 2 kv heads), untied head."""
    base = ModelConfig(
        vocab_size=128,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=128,
        rope_theta=10000.0,
        tie_embeddings=False,
        context_length=256,
    )
    return base.replace(**changes)


@functools.cache
def _init_program(config: ModelConfig):
    """`build_model(config).init` compiled as one program, once per config in a process (the seed is its
    argument); the run's compile cache serves it to the other processes."""
    return jax.jit(build_model(config).init)


def init_params(config: ModelConfig, seed: int):
    """The random params `build_model(config).init(jax.random.PRNGKey(seed))` gives, bit for bit (checked
    by tests/test_model.py): run eagerly, that init compiled its ops one by one, 4-7 s a call on 2 cores."""
    return _init_program(config)(jax.random.PRNGKey(seed))


def tiny_vq_config(**changes: Any) -> ModelConfig:
    """A small random-weight Transformer-VQ config: 2 layers (4 GAUs), 2 heads, 8 codes, window 4."""
    base = ModelConfig(
        vocab_size=128,
        dim=32,
        n_layers=2,
        n_heads=2,
        n_kv_heads=2,
        head_dim=8,
        ffn_dim=0,
        norm_eps=1e-6,
        tie_embeddings=True,
        context_length=256,
        memory="vq",
        vq_value_dim=16,
        vq_codes=8,
        vq_block_len=4,
        vq_mem_len=4,
    )
    return base.replace(**changes)


def load_grok_npz(path) -> tuple[ModelConfig, dict]:
    """The grok reference fixture: an .npz of grok-1 Haiku params with its config under meta/config_json."""
    data = np.load(path, allow_pickle=False)
    config = config_from_grok(json.loads(str(data["meta/config_json"])))
    return config, load_grok(data, config)


def golden_agreement(runner, golden: dict, tokenizer, label: str, max_tokens: int = 32) -> tuple[int, int]:
    """Greedy tokens of each golden SmolLM2 case that equal float32's before the first difference (printed
    per case) → (matched, total): how a quantized path's agreement is measured."""
    from hkserve.engine.requests import Request
    from hkserve.model.sampling import SamplingParams

    matched, total = 0, 0
    for case in golden["cases"]:
        request = Request(case["prompt_ids"], max_tokens, SamplingParams(), tokenizer.stop_ids)
        got = [t.id for t in runner.generate(request)]
        same = next((i for i, (a, b) in enumerate(zip(got, case["greedy_ids"])) if a != b), len(got))
        print(f"{label} {case['name']}: first {same} of {len(case['greedy_ids'])} greedy tokens equal float32's")
        matched, total = matched + same, total + len(case["greedy_ids"])
    return matched, total
