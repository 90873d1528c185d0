"""Training configs: the examples parse, and every mistake is reported by its dotted field path."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from hkserve.train.config import load_config, parse_config

REPO = Path(__file__).resolve().parents[1]

BASE = {
    "data": {"text": "kjv.txt", "split": {"train": 0.9, "validation": 0.05, "test": 0.05}},
    "tokenizer": "bytes",
    "model": {"memory": "kv", "dim": 64, "n_layers": 2, "n_heads": 4, "head_dim": 16, "n_kv_heads": 2, "ffn_dim": 128},
    "sequence_len": 256,
    "update_len": 64,
    "batch_size": 2,
    "steps": 10,
    "optimizer": {"lr": "3e-3"},
    "checkpoint": {"dir": "ck", "every": 4},
    "eval": {"every": 2},
}


@pytest.mark.parametrize("name", ["vq-kjv", "kv-kjv"])
def test_example_configs_are_valid(name):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    model = cfg.to_model_config(2048)
    assert model.memory == name[:2] and model.vocab_size == 2048


def test_a_valid_config_builds_its_model_config():
    cfg = parse_config(BASE)
    assert cfg.optimizer.lr == 3e-3  # YAML 1.1 reads 3e-3 as a string; it is still a float here
    model = cfg.to_model_config(259)
    assert (model.dim, model.n_kv_heads, model.context_length, model.output_multiplier) == (64, 2, 64, 64**-0.5)


def _error(change) -> str:
    data = copy.deepcopy(BASE)
    change(data)
    with pytest.raises(ValueError) as info:
        parse_config(data, "run.yaml")
    return str(info.value)


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda d: d["model"].update(dim=-1), "model.dim: Input should be greater than 0 (got -1)"),
        (lambda d: d["optimizer"].update(name="sgd"), "optimizer.name: Input should be 'adamw', 'lion' or 'adafactor'"),
        (lambda d: d["optimizer"].update(lr_max=1), "optimizer.lr_max: unknown field"),
        (lambda d: d.pop("steps"), "steps: Field required"),
        (lambda d: d.update(tokenizer="wordpiece"), "tokenizer: 'wordpiece' is not a tokenizer"),
        (lambda d: d.update(tokenizer={"sentencepeice": "x.model"}), "tokenizer.sentencepeice: unknown field"),
        (lambda d: d["model"].update(memory="vq"), "model: memory: vq needs vq_value_dim, vq_codes, vq_block_len"),
        (lambda d: d["model"].update(vq_codes=64), "vq_codes belong(s) to memory: vq, not kv"),
        (lambda d: d.update(update_len=48), "sequence_len=256 is not a multiple of update_len=48"),
        (lambda d: d["data"].update(train="a.txt"), "give either `text` + `split` or train/validation/test files"),
        (lambda d: d["data"]["split"].update(test=0.5), "data.split: train + validation + test = 1.45 exceeds 1"),
        (lambda d: d["checkpoint"].update(every=5), "checkpoint.every=5 must be a multiple of eval.every=2"),
        (lambda d: d.update(vq={"codebook_gamma": 1.5}), "vq.codebook_gamma: Input should be less than 1"),
    ],
)
def test_errors_name_the_bad_field(change, expected):
    message = _error(change)
    assert message.startswith("run.yaml: invalid training config:")
    assert expected in message, message


def test_vq_block_must_divide_the_update():
    data = copy.deepcopy(BASE)
    data["model"] = {
        "memory": "vq",
        "dim": 64,
        "n_layers": 1,
        "n_heads": 1,
        "head_dim": 32,
        "vq_value_dim": 128,
        "vq_codes": 32,
        "vq_block_len": 48,
        "vq_mem_len": 16,
    }
    with pytest.raises(ValueError, match="update_len=64 is not a multiple of model.vq_block_len=48"):
        parse_config(data)


def test_unreadable_files_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("data: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ValueError, match="a YAML mapping"):
        load_config(tmp_path / "list.yaml")
