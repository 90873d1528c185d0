"""The training run, as one YAML file validated by pydantic.

Every section forbids unknown keys, so a misspelt option is an error that names it instead of a
default silently used. Relative paths are taken from the working directory.

    data: {train: a.txt, validation: b.txt, test: c.txt}     # or {text: all.txt, split: {...}}
    tokenizer: bytes                                          # or {sentencepiece: vocab.model}
    model: {memory: vq, dim: 128, n_layers: 2, ...}
    sequence_len: 2048   update_len: 256   batch_size: 8   steps: 2000
    optimizer: {name: adamw, lr: 3.0e-3, schedule: cosine, warmup_steps: 100, ...}
    vq: {commit_beta: 1.0e-4, codebook_gamma: 0.99}
    checkpoint: {dir: runs/x/checkpoints, every: 100, keep: 3}
    eval: {every: 100, batches: 4}
    metrics: runs/x/metrics.jsonl
    export: my-model
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from hkserve.model.config import ModelConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class SplitFractions(_Section):
    """Fractions of one text file (cut at line ends, in this order: train, validation, test)."""

    train: float = Field(gt=0, le=1)
    validation: float = Field(gt=0, lt=1)
    test: float = Field(default=0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _sum(self):
        total = self.train + self.validation + self.test
        if total > 1 + 1e-9:
            raise ValueError(f"train + validation + test = {total:g} exceeds 1")
        return self


class DataConfig(_Section):
    """Either three files, or one `text` file cut by `split` fractions."""

    train: Path | None = None
    validation: Path | None = None
    test: Path | None = None
    text: Path | None = None
    split: SplitFractions | None = None

    @model_validator(mode="after")
    def _one_layout(self):
        files = [name for name in ("train", "validation", "test") if getattr(self, name) is not None]
        if self.text is not None:
            if files:
                raise ValueError(f"give either `text` + `split` or train/validation/test files, not both ({files})")
            if self.split is None:
                raise ValueError("`text` needs `split: {train: F, validation: F, test: F}`")
        else:
            if self.split is not None:
                raise ValueError("`split` needs `text: FILE`")
            if self.train is None or self.validation is None:
                raise ValueError("need `train` and `validation` files (or `text` + `split`)")
        return self


class TokenizerSpec(_Section):
    """`tokenizer: bytes` (UTF-8 bytes, 259 ids) or `tokenizer: {sentencepiece: FILE.model}`."""

    sentencepiece: Path | None = None  # a .model file written by `hkserve train-vocab`
    bytes: bool = False

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value):
        if isinstance(value, str):
            if value != "bytes":
                raise ValueError(f"{value!r} is not a tokenizer: use `bytes` or `{{sentencepiece: FILE.model}}`")
            return {"bytes": True}
        return value

    @model_validator(mode="after")
    def _exactly_one(self):
        if self.bytes == (self.sentencepiece is not None):
            raise ValueError("use `bytes` or `{sentencepiece: FILE.model}`")
        return self


class ModelSection(_Section):
    """The ModelConfig fields a run chooses; the vocabulary size comes from the tokenizer."""

    memory: Literal["vq", "kv"]
    dim: PositiveInt
    n_layers: PositiveInt
    n_heads: PositiveInt
    head_dim: PositiveInt
    tie_embeddings: bool = True  # output head = embeddingsᵀ, scaled by dim^-1/2 (embeddings are N(0, 1))
    # memory: kv
    n_kv_heads: PositiveInt | None = None
    ffn_dim: PositiveInt | None = None
    rope_theta: float = Field(default=10000.0, gt=0)
    # memory: vq
    vq_value_dim: PositiveInt | None = None
    vq_codes: PositiveInt | None = None
    vq_block_len: PositiveInt | None = None
    vq_mem_len: PositiveInt | None = None

    @model_validator(mode="after")
    def _fields_of_kind(self):
        own = {"kv": ("n_kv_heads", "ffn_dim"), "vq": ("vq_value_dim", "vq_codes", "vq_block_len", "vq_mem_len")}
        other = "kv" if self.memory == "vq" else "vq"
        missing = [f for f in own[self.memory] if getattr(self, f) is None]
        if missing:
            raise ValueError(f"memory: {self.memory} needs {', '.join(missing)}")
        foreign = [f for f in own[other] if getattr(self, f) is not None]
        if foreign:
            raise ValueError(f"{', '.join(foreign)} belong(s) to memory: {other}, not {self.memory}")
        return self

    def to_model_config(self, vocab_size: int, context_length: int) -> ModelConfig:
        fields = self.model_dump(exclude_none=True)
        if self.memory == "vq":  # a GAU stack: no MLP, no grouped KV heads, no RoPE
            fields.pop("rope_theta")
            fields.update(n_kv_heads=self.n_heads, ffn_dim=0)
        # Tied logits x·Eᵀ with E ~ N(0, 1) and x RMS-normed have std ~sqrt(dim): scale them back to ~1
        # (the reference's e_scale), so training starts near the uniform distribution.
        multiplier = self.dim**-0.5 if self.tie_embeddings else 1.0
        try:
            return ModelConfig(
                vocab_size=vocab_size, context_length=context_length, output_multiplier=multiplier, **fields
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"model: {e}") from None


class OptimizerConfig(_Section):
    name: Literal["adamw", "lion", "adafactor"] = "adamw"
    lr: float = Field(gt=0)
    schedule: Literal["cosine", "inverse_sqrt", "linear"] = "cosine"
    warmup_steps: int = Field(default=0, ge=0)
    end_lr_ratio: float = Field(default=0.1, ge=0, le=1)  # cosine/linear floor, as a fraction of lr
    grad_clip: float = Field(default=1.0, ge=0)  # global-norm clip; 0 = off
    weight_decay: float = Field(default=0.0, ge=0)  # decoupled; never on norms, biases or the codebook
    b1: float = Field(default=0.9, ge=0, lt=1)
    b2: float = Field(default=0.98, ge=0, lt=1)


class VQConfig(_Section):
    commit_beta: float = Field(default=1e-4, ge=0)  # weight of the commitment loss
    codebook_gamma: float = Field(default=0.99, gt=0, lt=1)  # codebook EMA decay per optimizer step


class CheckpointConfig(_Section):
    dir: Path
    every: PositiveInt = 100
    keep: PositiveInt = 3  # the last `keep` checkpoints, plus the best by validation loss


class EvalConfig(_Section):
    every: PositiveInt = 100
    batches: PositiveInt | None = None  # batch_size x sequence_len groups per validation; None = all


class TrainConfig(_Section):
    data: DataConfig
    tokenizer: TokenizerSpec
    model: ModelSection
    sequence_len: PositiveInt  # tokens over which the attention state is carried, then reset
    update_len: PositiveInt  # tokens per optimizer step (one chunk of every row)
    batch_size: PositiveInt
    steps: PositiveInt
    optimizer: OptimizerConfig
    vq: VQConfig = VQConfig()
    seed: int = 0
    checkpoint: CheckpointConfig
    eval: EvalConfig = EvalConfig()
    metrics: Path | None = None  # JSONL, one line per step and per validation
    export: str | None = None  # model-store name written at the end

    @model_validator(mode="after")
    def _lengths(self):
        if self.sequence_len % self.update_len:
            raise ValueError(f"sequence_len={self.sequence_len} is not a multiple of update_len={self.update_len}")
        block = self.model.vq_block_len
        if self.model.memory == "vq" and self.update_len % block:
            raise ValueError(f"update_len={self.update_len} is not a multiple of model.vq_block_len={block}")
        if self.optimizer.warmup_steps >= self.steps:
            raise ValueError(f"optimizer.warmup_steps={self.optimizer.warmup_steps} must be below steps={self.steps}")
        if self.checkpoint.every % self.eval.every:
            raise ValueError(
                f"checkpoint.every={self.checkpoint.every} must be a multiple of eval.every="
                f"{self.eval.every}, so every checkpoint has the validation loss that picks the best"
            )
        return self

    @property
    def context_length(self) -> int:
        """Positions one forward attends over: a KV model sees one update, a VQ model a sequence."""
        return self.update_len if self.model.memory == "kv" else self.sequence_len

    def to_model_config(self, vocab_size: int) -> ModelConfig:
        return self.model.to_model_config(vocab_size, self.context_length)


def _describe(error: dict) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "(top level)"
    message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"].removeprefix("Value error, ")
    if error["type"] not in ("missing", "extra_forbidden", "value_error") and not isinstance(error.get("input"), dict):
        message += f" (got {error.get('input')!r})"
    return f"  {where}: {message}"


def parse_config(data: object, source: str = "config") -> TrainConfig:
    """Validate a parsed YAML document; errors name each bad field by its dotted path."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a training config is a YAML mapping, got {type(data).__name__}")
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        lines = sorted({_describe(err) for err in e.errors()})
        raise ValueError(f"{source}: invalid training config:\n" + "\n".join(lines)) from None


def load_config(path: str | Path) -> TrainConfig:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training config {path} not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    return parse_config(data, str(path))
