"""`hkserve train | train-vocab | validation | test`.

`register(subparsers)` adds the commands to hkserve's parser (hkserve/cli/main.py). Results go to stdout,
progress and logs to stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hkserve.train.export import export_model
from hkserve.train.loop import train
from hkserve.train.session import Session
from hkserve.train.vocab import sentencepiece_tokenizer, train_sentencepiece


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_train(args) -> int:
    session = Session.open(args.config)
    try:
        state = train(session, progress=not args.quiet)
    finally:
        session.close()
    name = args.export or session.cfg.export
    if name:
        path = export_model(session, state, name)
        print(f'exported step {int(state.step)} as {name!r} to {path}; try: hkserve generate --model {name} "..."')
    return 0


def cmd_train_vocab(args) -> int:
    model_file = train_sentencepiece([Path(p) for p in args.input], args.vocab_size, Path(args.output), args.model_type)
    tokenizer = sentencepiece_tokenizer(model_file)
    print(f"{model_file}: {tokenizer.vocab_size} pieces; use it with `tokenizer: {{sentencepiece: {model_file}}}`")
    return 0


def cmd_evaluate(args) -> int:
    session = Session.open(args.config, read_only=True)
    try:
        step = session.checkpoints.resolve(args.checkpoint)
        result = session.evaluate(session.restore(step), args.command, max_groups=args.batches)
    finally:
        session.close()
    print(
        f"{args.command} @ step {step}: loss {result.loss:.4f} nats/token, {result.bits_per_byte:.4f} bits/byte "
        f"over {result.tokens} tokens ({result.bytes} bytes)",
        flush=True,
    )
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a model from a YAML config (resumes from its latest checkpoint)")
    p.add_argument("--config", required=True, help="training config (YAML)")
    p.add_argument(
        "--export",
        default=None,
        metavar="NAME",
        help="model-store name to save at the end (default: the config's `export`)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    p = subparsers.add_parser("train-vocab", help="train a SentencePiece tokenizer (byte fallback) on text files")
    p.add_argument("--input", nargs="+", required=True, metavar="FILE")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    p.set_defaults(func=cmd_train_vocab)

    for split in ("validation", "test"):
        p = subparsers.add_parser(split, help=f"loss and bits per byte of a checkpoint on the {split} split")
        p.add_argument("--config", required=True, help="training config (YAML)")
        p.add_argument("--checkpoint", default="best", help="best | latest | STEP (default: best)")
        p.add_argument("--batches", type=int, default=None, help="evaluate only the first N batch groups")
        p.set_defaults(func=cmd_evaluate)
