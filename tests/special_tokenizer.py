"""A tiny byte-level `tokenizers` tokenizer whose tool-call markers and reasoning tags are special tokens
(Mistral's `[TOOL_CALLS]` and `[ARGS]`, Llama 3.1's `<|python_tag|>`, `<think>`/`</think>`), as the
families that use them ship it: a decode skips them, a grammar must write them as their tokens."""

from __future__ import annotations

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from hkserve.checkpoint.tokenizer import Tokenizer

EOS, TOOL_CALLS, ARGS, PYTHON_TAG = "<|eos|>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"
THINK, END_THINK = "<think>", "</think>"
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


def special_tokenizer(specials: tuple[str, ...] = (TOOL_CALLS, ARGS, PYTHON_TAG, THINK, END_THINK)) -> Tokenizer:
    """One token per byte, and EOS and `specials` (by default the three call markers and the reasoning
    tags) as special (added, skipped by a decode) tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (EOS, *specials)])
    return Tokenizer("hf", backend, bos_id=None, eos_id=backend.token_to_id(EOS), chat_template=TEMPLATE)


TOKENIZER = special_tokenizer()


def ids(pieces: list[str]) -> list[int]:
    """The pieces as the model writes them: a marker as its one special token, text byte by byte."""
    out: list[int] = []
    for piece in pieces:
        marker = TOKENIZER.special_id(piece)
        out += [marker] if marker is not None else TOKENIZER.encode(piece)
    return out
