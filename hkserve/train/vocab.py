"""Tokenizers a training run can use, as checkpoint.tokenizer.Tokenizer so they save into the model
store and serve unchanged: a SentencePiece model trained here, or plain UTF-8 bytes.

Both are lossless (decode(encode(text)) == text): bits per byte is only honest when every byte of
the text is predicted, including newlines and runs of spaces. Ids 0/1/2 are <unk>/<s>/</s>.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_pb2

from hkserve.checkpoint.tokenizer import BYTE, CONTROL, UNKNOWN, Tokenizer

BOS_ID, EOS_ID = 1, 2


def train_sentencepiece(inputs: list[Path], vocab_size: int, output_prefix: Path, model_type: str = "bpe") -> Path:
    """Train on the lines of `inputs`; write PREFIX.model and PREFIX.vocab. Newlines get a piece of
    their own (the trainer never sees them inside a line) and unseen characters fall back to bytes."""
    missing = [str(p) for p in inputs if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"train-vocab: no such input file(s): {', '.join(missing)}")
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            input=",".join(str(p) for p in inputs),
            model_prefix=str(output_prefix),
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            user_defined_symbols=["\n"],
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            unk_id=0,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=-1,
            num_threads=2,
            minloglevel=2,
        )
    except RuntimeError as e:  # e.g. "Vocabulary size too high (4096). Please set it to a value <= 648."
        raise ValueError(f"train-vocab: {str(e).split('] ')[-1]}") from None
    return Path(f"{output_prefix}.model")


def sentencepiece_tokenizer(model_file: Path) -> Tokenizer:
    if not Path(model_file).is_file():
        raise FileNotFoundError(f"sentencepiece model {model_file} not found (make one with `hkserve train-vocab`)")
    backend = spm.SentencePieceProcessor(model_file=str(model_file))
    return Tokenizer("sentencepiece", backend, bos_id=BOS_ID, eos_id=EOS_ID, add_bos=True)


def byte_tokenizer() -> Tokenizer:
    """UTF-8 bytes as a SentencePiece model with only byte pieces (id = byte + 3): the server already
    serves SentencePiece, so no new tokenizer kind is needed. Whitespace is not escaped to U+2581."""
    proto = sp_pb2.ModelProto()
    for piece, kind in [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)]:
        proto.pieces.add(piece=piece, type=kind, score=0.0)
    for byte in range(256):
        proto.pieces.add(piece=f"<0x{byte:02X}>", type=BYTE, score=0.0)
    spec = proto.trainer_spec
    spec.model_type, spec.byte_fallback = sp_pb2.TrainerSpec.BPE, True
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = 0, BOS_ID, EOS_ID, -1
    norm = proto.normalizer_spec
    norm.name, norm.add_dummy_prefix, norm.remove_extra_whitespaces, norm.escape_whitespaces = (
        "identity",
        False,
        False,
        False,
    )
    backend = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    return Tokenizer("sentencepiece", backend, bos_id=BOS_ID, eos_id=EOS_ID, add_bos=True)


def load_tokenizer(spec) -> Tokenizer:
    """The tokenizer a config's `tokenizer:` section names."""
    return byte_tokenizer() if spec.bytes else sentencepiece_tokenizer(spec.sentencepiece)


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """[V] int64: UTF-8 bytes each id stands for (0 for control and unknown ids), to turn token NLL
    into bits per byte."""
    backend = tokenizer.backend
    return np.array(
        [
            0 if backend.is_control(i) or backend.is_unknown(i) else len(tokenizer.token_bytes(i))
            for i in range(tokenizer.vocab_size)
        ],
        np.int64,
    )
