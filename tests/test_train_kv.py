"""Training the KV baseline through the CLI with a SentencePiece vocabulary trained for it: the loss
falls, checkpoints keep the last K plus the best, `validation`/`test` report bits per byte that
follow from the loss, and the export lands in the model store with its tokenizer."""

from __future__ import annotations

import math
import os
import re

import jax
import numpy as np
import pytest
from train_helpers import read_metrics, write_run, write_texts

from hkserve.cli.main import main as hkserve_main
from hkserve.train.vocab import train_sentencepiece

REPORT = re.compile(
    r"(\w+) @ step (\d+): loss ([\d.]+) nats/token, ([\d.]+) bits/byte over (\d+) tokens \((\d+) bytes\)"
)


@pytest.fixture(scope="module")
def kv_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-run")
    write_texts(root)
    vocab = train_sentencepiece([root / "train.txt"], 400, root / "vocab")
    config = write_run(root, "kv", tokenizer={"sentencepiece": str(vocab)})
    home, previous = root / "home", os.environ.get("HKSERVE_HOME")
    os.environ["HKSERVE_HOME"] = str(home)
    try:
        assert hkserve_main(["train", "--config", str(config), "--quiet", "--export", "tiny-kv"]) == 0
        yield root, config, home
    finally:
        if previous is None:
            os.environ.pop("HKSERVE_HOME")
        else:
            os.environ["HKSERVE_HOME"] = previous


def test_kv_training_loss_decreases(kv_run):
    root, _, _ = kv_run
    train_lines, validation = read_metrics(root / "metrics.jsonl")
    assert sorted(train_lines) == list(range(1, 31)) and sorted(validation) == list(range(3, 31, 3))
    first = np.mean([train_lines[s]["nll"] for s in (1, 2, 3)])
    last = np.mean([train_lines[s]["nll"] for s in (28, 29, 30)])
    assert first > 5.0 and last < first - 1.5, (first, last)  # uniform over 400 pieces: ln 400 = 5.99
    assert validation[30]["loss"] < validation[3]["loss"] - 1.0
    assert all(line["commit"] == 0.0 and line["tokens_per_s"] > 0 for line in train_lines.values())


def test_checkpoints_keep_the_last_two_and_the_best(kv_run):
    root, _, _ = kv_run
    _, validation = read_metrics(root / "metrics.jsonl")
    best = min(validation, key=lambda s: validation[s]["loss"])
    kept = sorted(int(p.name) for p in (root / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == sorted({27, 30, best})


def test_the_best_checkpoint_outlives_the_last_k(tmp_path):
    from hkserve.train.checkpoints import Checkpoints
    from hkserve.train.step import TrainState

    checkpoints = Checkpoints(tmp_path / "ck", keep=2)
    for step, val_loss in zip(range(1, 6), [5.0, 1.0, 4.0, 3.0, 2.0]):
        state = TrainState(np.int32(step), {"w": np.full(3, step, np.float32)}, {}, (), ())
        checkpoints.save(state, val_loss)
    assert checkpoints.manager.all_steps() == [2, 4, 5]
    assert [checkpoints.resolve(w) for w in ("best", "latest", "4")] == [2, 5, 4]
    restored = checkpoints.restore(2, state)
    assert int(restored.step) == 2 and restored.params["w"].tolist() == [2.0] * 3
    checkpoints.close()


def _report(capsys, *args) -> tuple:
    assert hkserve_main(list(args)) == 0
    split, step, loss, bpb, tokens, n_bytes = REPORT.search(capsys.readouterr().out).groups()
    return split, int(step), float(loss), float(bpb), int(tokens), int(n_bytes)


def test_validation_and_test_report_bits_per_byte(kv_run, capsys):
    root, config, _ = kv_run
    _, validation = read_metrics(root / "metrics.jsonl")
    best = min(validation, key=lambda s: validation[s]["loss"])
    for split in ("validation", "test"):
        name, step, loss, bpb, tokens, n_bytes = _report(capsys, split, "--config", str(config))
        assert (name, step) == (split, best)
        assert n_bytes == len((root / f"{split}.txt").read_text().encode())  # every byte of the split
        assert tokens < n_bytes  # SentencePiece merges: fewer tokens than bytes
        assert bpb == pytest.approx(loss * tokens / (math.log(2) * n_bytes), rel=1e-3)
    # in training, validation scored only the first batch group: the same first tokens
    _, step, loss, _, tokens, _ = _report(
        capsys, "validation", "--config", str(config), "--checkpoint", "30", "--batches", "1"
    )
    assert (step, tokens) == (30, validation[30]["tokens"])
    assert loss == pytest.approx(validation[30]["loss"], abs=1e-4)


def test_evaluation_names_a_missing_checkpoint(kv_run, capsys):
    _, config, _ = kv_run
    assert hkserve_main(["test", "--config", str(config), "--checkpoint", "7"]) == 1
    assert "checkpoint '7' not found" in capsys.readouterr().err


def test_export_is_servable_from_the_store(kv_run):
    from hkserve.checkpoint.store import ModelStore
    from hkserve.train.session import Session

    root, config, home = kv_run
    store = ModelStore(home)
    info = store.info("tiny-kv")
    assert (info.config.memory, info.config.vocab_size, info.source["step"]) == ("kv", 400, 30)
    session = Session.open(config, read_only=True)
    trained = session.restore(30).params
    session.close()
    jax.tree_util.tree_map(np.testing.assert_array_equal, store.params("tiny-kv"), jax.device_get(trained))
    tokenizer = store.tokenizer("tiny-kv")
    text = (root / "test.txt").read_text()
    assert tokenizer.decode(tokenizer.encode(text)) == text
