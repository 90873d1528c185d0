"""One tokenizer interface over HF `tokenizers` (BPE) and sentencepiece, with special ids and chat template.

Sources: GGUF metadata (`gpt2` BPE rebuilt with `tokenizers`, `llama` SentencePiece rebuilt as a
ModelProto), an HF directory (tokenizer.json or tokenizer.model), or the model store (saved form).
"""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_pb2
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from hkserve.checkpoint.gguf_reader import field
from hkserve.checkpoint.params import ImportFormatError

# GGUF token types (same numbering as sentencepiece piece types).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _bpe_pre_tokenizer(pre: str | None):
    """The pre-tokenizer llama.cpp associates with `tokenizer.ggml.pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in (None, "default", "gpt2", "gpt-2"):
        return byte_level
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if split is None:
        raise ImportFormatError(f"unsupported BPE pre-tokenizer {pre!r} (tokenizer.ggml.pre)")
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _chat_environment() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class Tokenizer:
    """encode/decode text, special ids, and chat rendering. `backend` is a tokenizers.Tokenizer or an
    spm.SentencePieceProcessor (kind "hf" / "sentencepiece")."""

    def __init__(
        self,
        kind: str,
        backend,
        *,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        extra_stop_ids: tuple[int, ...] = (),
    ):
        self.kind, self.backend = kind, backend
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.add_bos, self.chat_template = add_bos, chat_template
        self.stop_ids = tuple(sorted({i for i in (eos_id, *extra_stop_ids) if i is not None}))
        self._template = _chat_environment().from_string(chat_template) if chat_template else None

    # -- text <-> ids ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size() if self.kind == "hf" else self.backend.get_piece_size()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        if self.kind == "hf":
            ids = self.backend.encode(text, add_special_tokens=False).ids
        else:
            ids = self.backend.encode(text)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return list(ids)

    def decode(self, ids: list[int], skip_special: bool = True, keep: frozenset[int] = frozenset()) -> str:
        """`keep`: special ids written out even when skipping the others (the tool-call and reasoning
        markers a reply parser reads, such as Mistral's `[TOOL_CALLS]`). An id past the tokenizer's
        vocabulary (a model's padded embedding rows, which sampling can reach) has no text, as in HF
        `tokenizers`; sentencepiece would raise and end the reply's stream."""
        size = self.vocab_size  # once: decode runs for every streamed token
        ids = [i for i in map(int, ids) if 0 <= i < size]
        if self.kind == "hf":
            if skip_special and keep:
                ids, skip_special = [i for i in ids if i in keep or i not in self._special_ids], False
            return self.backend.decode(ids, skip_special_tokens=skip_special)
        if not skip_special:
            return self.backend.decode(ids)
        out, run = [], []  # SentencePiece writes control pieces as nothing: a kept one goes in by hand
        for i in ids:
            if i in keep:
                out += [self.backend.decode(run), self.token_text(i)]
                run = []
            elif not self.backend.is_control(i):
                run.append(i)
        return "".join(out) + self.backend.decode(run)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        """The ids a `tokenizers` decode skips as special."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    def special_id(self, text: str) -> int | None:
        """The id of `text` when it is one special (control) token, which a decode skips; else None."""
        if self.kind == "hf":
            token_id = self.backend.token_to_id(text)
            return token_id if token_id in self._special_ids else None
        token_id = self.backend.piece_to_id(text)
        return token_id if token_id != self.backend.unk_id() and self.backend.is_control(token_id) else None

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a byte-level token may be part of a character)."""
        piece = self.token_text(token_id)
        if self.kind == "sentencepiece":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode()
        table = _byte_decoder()
        if piece and all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return piece.encode()

    def token_text(self, token_id: int) -> str:
        """The token's piece; "" for an id past the vocabulary (see `decode`)."""
        if not 0 <= int(token_id) < self.vocab_size:
            return ""
        if self.kind == "hf":
            return self.backend.id_to_token(int(token_id)) or ""
        return self.backend.id_to_piece(int(token_id))

    def has_token(self, text: str) -> bool:
        """Whether `text` is one token of the vocabulary (e.g. an added `<think>`)."""
        if self.kind == "hf":
            return self.backend.token_to_id(text) is not None
        return self.backend.piece_to_id(text) != self.backend.unk_id()

    # -- chat -----------------------------------------------------------------------------------
    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` variable (else the server writes its own tool prompt)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """`variables`: more the template may read (e.g. Qwen3's enable_thinking)."""
        if self._template is None:
            raise ValueError("this model has no chat template")
        extra = {**(variables or {}), **({} if tools is None else {"tools": tools})}
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **extra,
                bos_token=self.token_text(self.bos_id) if self.bos_id is not None else "",
                eos_token=self.token_text(self.eos_id) if self.eos_id is not None else "",
            )
        except jinja2.TemplateError as e:  # the template refused these messages (raise_exception)
            raise ValueError(f"chat template: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The template writes any BOS itself, so none is added on top."""
        return self.encode(self.render_chat(messages), add_bos=False)

    # -- persistence ----------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        if self.kind == "hf":
            self.backend.save(str(directory / "tokenizer.json"))
        else:
            (directory / "tokenizer.model").write_bytes(self.backend.serialized_model_proto())
        meta = {
            "kind": self.kind,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "add_bos": self.add_bos,
            "chat_template": self.chat_template,
            "extra_stop_ids": [i for i in self.stop_ids if i != self.eos_id],
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(meta, indent=2))

    @classmethod
    def load(cls, directory: Path) -> Tokenizer:
        meta = json.loads((directory / "tokenizer_config.json").read_text())
        kind = meta.pop("kind")
        if kind == "hf":
            backend = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        else:
            backend = spm.SentencePieceProcessor(model_proto=(directory / "tokenizer.model").read_bytes())
        meta["extra_stop_ids"] = tuple(meta.get("extra_stop_ids", ()))
        return cls(kind, backend, **meta)

    # -- sources --------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader) -> Tokenizer:
        model = field(reader, "tokenizer.ggml.model")
        tokens = field(reader, "tokenizer.ggml.tokens")
        if model is None or tokens is None:
            raise ImportFormatError("GGUF has no tokenizer metadata")
        types = field(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        ids = {k: field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding", "eot", "eom")}
        if model == "gpt2":
            backend = _bpe_from_vocab(
                tokens, field(reader, "tokenizer.ggml.merges") or [], types, field(reader, "tokenizer.ggml.pre")
            )
            kind, default_bos = "hf", False
        elif model == "llama":
            scores = field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
            add_space = field(reader, "tokenizer.ggml.add_space_prefix", True)
            backend = _sentencepiece_from_vocab(tokens, scores, types, add_space, ids)
            kind, default_bos = "sentencepiece", True
        else:
            raise ImportFormatError(f"unsupported GGUF tokenizer model {model!r} (supported: gpt2, llama)")
        extra = tuple(i for i in (ids["eot"], ids["eom"]) if i is not None)
        return cls(
            kind,
            backend,
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            pad_id=ids["padding"],
            add_bos=bool(field(reader, "tokenizer.ggml.add_bos_token", default_bos)),
            chat_template=field(reader, "tokenizer.chat_template"),
            extra_stop_ids=extra,
        )

    @classmethod
    def from_hf_dir(cls, directory: Path) -> Tokenizer | None:
        """None when the directory carries no tokenizer (weights-only checkpoints)."""
        tcfg = _read_json(directory / "tokenizer_config.json")
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text()
        if (directory / "tokenizer.json").is_file():
            backend, kind = HFTokenizer.from_file(str(directory / "tokenizer.json")), "hf"
            to_id = backend.token_to_id
        elif (directory / "tokenizer.model").is_file():
            backend = spm.SentencePieceProcessor(model_file=str(directory / "tokenizer.model"))
            kind = "sentencepiece"
            to_id = lambda piece: backend.piece_to_id(piece) if backend.piece_to_id(piece) != backend.unk_id() else None
        else:
            return None
        model_cfg = _read_json(directory / "config.json")

        def special(name: str) -> int | None:
            token = tcfg.get(f"{name}_token")
            if isinstance(token, dict):
                token = token.get("content")
            if token is not None and to_id(token) is not None:
                return to_id(token)
            value = model_cfg.get(f"{name}_token_id")
            return value[0] if isinstance(value, list) else value

        eos_cfg = _read_json(directory / "generation_config.json").get("eos_token_id", model_cfg.get("eos_token_id"))
        extra = tuple(eos_cfg) if isinstance(eos_cfg, list) else ()
        return cls(
            kind,
            backend,
            bos_id=special("bos"),
            eos_id=special("eos"),
            pad_id=special("pad"),
            add_bos=bool(tcfg.get("add_bos_token", kind == "sentencepiece")),
            chat_template=template,
            extra_stop_ids=extra,
        )


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level alphabet: printable stand-in character → byte."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _bpe_from_vocab(tokens: list[str], merges: list[str], types: list[int], pre: str | None) -> HFTokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tk.pre_tokenizer = _bpe_pre_tokenizer(pre)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    )
    tk.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    )
    return tk


def _sentencepiece_from_vocab(tokens, scores, types, add_space_prefix: bool, ids: dict) -> spm.SentencePieceProcessor:
    proto = sp_pb2.ModelProto()
    for tok, score, ty in zip(tokens, scores, types):
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = tok, float(score), int(ty) if int(ty) in range(1, 7) else NORMAL
    proto.trainer_spec.model_type = sp_pb2.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = any(int(t) == BYTE for t in types)
    proto.trainer_spec.unk_id = next((i for i, t in enumerate(types) if int(t) == UNKNOWN), 0)
    proto.trainer_spec.bos_id = -1 if ids["bos"] is None else ids["bos"]
    proto.trainer_spec.eos_id = -1 if ids["eos"] is None else ids["eos"]
    proto.trainer_spec.pad_id = -1 if ids["padding"] is None else ids["padding"]
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = bool(add_space_prefix)
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
