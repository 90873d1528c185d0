"""Training Transformer-VQ: a run killed with SIGKILL resumes bit for bit, the loss falls, the codebook
moves only by its EMA, and the result serves from the model store.

One run is shared by the tests (compiling the VQ step is the expensive part): `hkserve train` in a
subprocess that SIGKILLs itself right after logging step KILL_AFTER (HKSERVE_TRAIN_KILL_AFTER_STEP),
when its latest checkpoint is step KILL_AFTER - 1, in the middle of a sequence; then resumed in this
process to the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from helpers import REPO, hkserve
from http_helpers import LiveServer
from train_helpers import read_metrics, write_run

from hkserve.api.app import create_app
from hkserve.checkpoint.store import ModelStore
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.vq_model import serving_params
from hkserve.train.checkpoints import Checkpoints
from hkserve.train.data import TrainStream
from hkserve.train.export import export_model
from hkserve.train.loop import KILL_AFTER_STEP_ENV, train
from hkserve.train.optim import decay_mask
from hkserve.train.session import Session

CHUNKS = 4  # sequence_len / update_len of write_run's config
KILL_AFTER = 4  # checkpoints every 3 steps: the latest is step 3, mid-sequence, and step 4 is logged


@pytest.fixture(scope="module")
def vq_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("vq-run")
    config = write_run(root, "vq")
    killed = subprocess.run(
        [sys.executable, "-m", "hkserve.cli.main", "train", "--config", str(config), "--quiet"],
        cwd=REPO,
        env={**os.environ, KILL_AFTER_STEP_ENV: str(KILL_AFTER)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, (
        f"the trainer was not killed at step {KILL_AFTER}:\n{killed.stderr[-3000:]}"
    )
    checkpoints = Checkpoints(root / "checkpoints", read_only=True)
    resumed_from = checkpoints.latest_step()
    checkpoints.close()
    shutil.copy(root / "metrics.jsonl", root / "killed-metrics.jsonl")
    session = Session.open(config)
    state = train(session, progress=False)
    yield session, state, resumed_from, root
    session.close()


def test_resume_after_sigkill_repeats_the_uninterrupted_steps(vq_run):
    _, state, resumed_from, root = vq_run
    killed, _ = read_metrics(root / "killed-metrics.jsonl")
    resumed, _ = read_metrics(root / "metrics.jsonl")
    assert resumed_from == KILL_AFTER - 1 and sorted(killed) == list(range(1, KILL_AFTER + 1))
    assert resumed_from % CHUNKS, "the checkpoint must sit mid-sequence, so the carried state is restored"
    assert sorted(resumed) == list(range(1, 31))
    keys = ("loss", "nll", "commit", "grad_norm", "lr")
    for step in sorted(killed):  # before the kill: kept; after the checkpoint: recomputed identically
        assert {k: resumed[step][k] for k in keys} == {k: killed[step][k] for k in keys}, step
    assert int(state.step) == 30


def test_vq_training_loss_decreases(vq_run):
    _, _, _, root = vq_run
    train_lines, validation = read_metrics(root / "metrics.jsonl")
    first = np.mean([train_lines[s]["nll"] for s in (1, 2, 3)])
    last = np.mean([train_lines[s]["nll"] for s in (28, 29, 30)])
    assert first > 5.0 and last < first - 1.5, (first, last)  # bytes: uniform would be ln 259 = 5.56
    assert validation[30]["loss"] < validation[3]["loss"] - 1.0
    assert all(train_lines[s]["commit"] > 0 for s in train_lines)


def test_the_optimizer_never_sees_the_codebook(vq_run):
    _, state, _, _ = vq_run
    assert state.codebook and not set(state.codebook) & set(state.params)
    opt_paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(state.opt_state)]
    assert opt_paths and not any("codebook" in p for p in opt_paths)
    mask = decay_mask(state.params)
    assert all(mask[m]["w"] for m in state.params if "w" in state.params[m])
    assert mask["decoder/embed"]["embeddings"]
    spared = [(m, n) for m, leaves in mask.items() for n, decays in leaves.items() if not decays]
    assert sorted(n for _, n in spared) == ["b", "bias", "scale", "scale", "xl_u", "xl_v"], spared


def test_the_codebook_moves_only_by_its_ema(vq_run):
    """One step: codebook' = γ·codebook + (1-γ)·(sums over this step's keys), and the counts grow
    by exactly one per token, GAU and head."""
    session, state, _, _ = vq_run
    cfg, model = session.cfg, session.model
    gamma = cfg.vq.codebook_gamma
    batch = TrainStream(session.ids("train"), cfg.batch_size, cfg.sequence_len, cfg.update_len, cfg.seed).batch_at(31)
    _, aux, _ = jax.jit(model.forward, static_argnums=4)(state.params, state.codebook, batch.inputs, state.carry, True)
    after, _ = session.train_step(state, batch)
    expected = jax.tree_util.tree_map(lambda c, s: gamma * c + (1 - gamma) * s, state.codebook, aux.stats)
    jax.tree_util.tree_map(
        lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7), after.codebook, expected
    )
    (path,) = state.codebook
    counts_before = jnp.sum(state.codebook[path]["c_count"], axis=-1)  # [G, H]
    counts_after = jnp.sum(after.codebook[path]["c_count"], axis=-1)
    tokens = cfg.batch_size * cfg.update_len
    np.testing.assert_allclose(counts_after, gamma * counts_before + (1 - gamma) * tokens, rtol=1e-5)


def test_export_serves_from_the_store(vq_run, tmp_path):

    session, state, _, _ = vq_run
    store = ModelStore(tmp_path)
    export_model(session, state, "tiny-vq", store)
    info = store.info("tiny-vq")
    assert info.config == session.model.config and info.config.memory == "vq"
    assert info.source["step"] == 30
    restored = store.params("tiny-vq")
    expected = serving_params(state.params, state.codebook)
    jax.tree_util.tree_map(np.testing.assert_array_equal, restored, jax.device_get(expected))
    tokenizer = store.tokenizer("tiny-vq")
    assert tokenizer.decode(tokenizer.encode("And God said")) == "And God said"


@pytest.mark.slow
def test_hkserve_generate_runs_the_exported_model(vq_run, tmp_path):

    session, state, _, _ = vq_run
    export_model(session, state, "tiny-vq", ModelStore(tmp_path))
    result = hkserve(
        "generate",
        "--model",
        "tiny-vq",
        "--max-tokens",
        "16",
        "--temperature",
        "0",
        "--max-len",
        "64",
        "And God said",
        home=tmp_path,
    )
    assert "(16 tokens)" in result.stderr, result.stderr[-2000:]  # (30 steps of bytes: greedy gives spaces)


def test_the_exported_vq_model_streams_over_http_like_a_kv_model(vq_run, tmp_path):
    """The trained VQ model behind the OpenAI API: streamed and whole completions agree for a seed."""

    session, state, _, _ = vq_run
    store = ModelStore(tmp_path)
    export_model(session, state, "tiny-vq", store)
    config = store.config("tiny-vq")
    engine = Engine(
        build_model(config), store.params("tiny-vq"), EngineOptions(slots=2, max_len=256, prefill_buckets=(16,))
    )
    runner = InferenceRunner(engine).start(warmup=False)
    server = LiveServer(create_app(runner, store.tokenizer("tiny-vq"), "tiny-vq", engine.max_len))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        common = {"model": "tiny-vq", "prompt": "And God said", "max_tokens": 12, "temperature": 0.9, "seed": 5}
        whole = client.completions.create(**common)
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **common) if c.choices)
        assert streamed == whole.choices[0].text and whole.usage.completion_tokens == 12
    finally:
        server.stop()
        runner.stop()
