"""Tiny training runs for the train tests: a public-domain text and configs small enough that a run
compiles and trains in seconds on two CPU cores."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

# Genesis 1:1-13, King James Version (public domain).
GENESIS = """In the beginning God created the heaven and the earth.
And the earth was without form, and void; and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.
And God said, Let there be light: and there was light.
And God saw the light, that it was good: and God divided the light from the darkness.
And God called the light Day, and the darkness he called Night. And the evening and the morning were the first day.
And God said, Let there be a firmament in the midst of the waters, and let it divide the waters from the waters.
And God made the firmament, and divided the waters which were under the firmament from the waters which were above the firmament: and it was so.
And God called the firmament Heaven. And the evening and the morning were the second day.
And God said, Let the waters under the heaven be gathered together unto one place, and let the dry land appear: and it was so.
And God called the dry land Earth; and the gathering together of the waters called he Seas: and God saw that it was good.
And God said, Let the earth bring forth grass, the herb yielding seed, and the fruit tree yielding fruit after his kind, whose seed is in itself, upon the earth: and it was so.
And the earth brought forth grass, and herb yielding seed after his kind, and the tree yielding fruit, whose seed is in itself, after his kind: and God saw that it was good.
And the evening and the morning were the third day.
"""

MODELS = {
    "vq": {
        "memory": "vq",
        "dim": 32,
        "n_layers": 1,
        "n_heads": 1,
        "head_dim": 16,
        "vq_value_dim": 64,
        "vq_codes": 16,
        "vq_block_len": 16,
        "vq_mem_len": 16,
    },
    "kv": {"memory": "kv", "dim": 32, "n_layers": 1, "n_heads": 2, "head_dim": 16, "n_kv_heads": 2, "ffn_dim": 64},
}


def write_texts(root: Path) -> None:
    """train.txt: the passage 6 times; validation.txt and test.txt: once, in other orders of its lines."""
    root.mkdir(parents=True, exist_ok=True)
    lines = GENESIS.splitlines(keepends=True)
    (root / "train.txt").write_text(GENESIS * 6)
    (root / "validation.txt").write_text("".join(lines[1::2] + lines[::2]))
    (root / "test.txt").write_text("".join(reversed(lines)))


def write_run(root: Path, memory: str, tokenizer="bytes", **overrides) -> Path:
    """Texts and a config under `root` → the config path. 30 steps of 128-token sequences in 4
    updates of 32, batch 2; validation and a checkpoint every 3 steps."""
    write_texts(root)
    config = {
        "data": {split: str(root / f"{split}.txt") for split in ("train", "validation", "test")},
        "tokenizer": tokenizer,
        "model": MODELS[memory],
        "sequence_len": 128,
        "update_len": 32,
        "batch_size": 2,
        "steps": 30,
        "optimizer": {"name": "adamw", "lr": 1e-2, "warmup_steps": 3, "weight_decay": 0.01},
        "checkpoint": {"dir": str(root / "checkpoints"), "every": 3, "keep": 2},
        "eval": {"every": 3, "batches": 1},
        "metrics": str(root / "metrics.jsonl"),
        **overrides,
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def read_metrics(path: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """({step: train line}, {step: validation line}) of a metrics JSONL; a line torn by a kill is skipped."""
    train, validation = {}, {}
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        (validation if record.get("split") == "validation" else train)[record["step"]] = record
    return train, validation
