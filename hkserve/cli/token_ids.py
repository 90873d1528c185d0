"""Token ids on the command line (--ids 5,17,3), for models with or without a tokenizer."""

from __future__ import annotations

from hkserve.checkpoint.store import ModelStore


def parse_ids(text: str) -> list[int]:
    """ "5,17,3" → [5, 17, 3]; a ValueError that says what was wrong otherwise."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--ids must be comma-separated token ids, got {text!r}") from None
    if not ids:
        raise ValueError("--ids is empty")
    return ids


def prompt_ids(args, store: ModelStore) -> list[int]:
    """The prompt's ids: --ids as given, else PROMPT encoded with the model's tokenizer."""
    if args.ids is not None:
        ids = parse_ids(args.ids)
        vocab = store.config(args.model).vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return ids
    if args.prompt is None:
        raise ValueError("give a PROMPT or --ids")
    return store.tokenizer(args.model).encode(args.prompt)
