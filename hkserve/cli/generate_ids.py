"""`hkserve generate --ids ... [--output-ids]`: a completion from token ids and/or as token ids, so a
model without a tokenizer (an HF checkpoint of weights only) can be run and compared."""

from __future__ import annotations

import os

from hkserve.checkpoint.store import ModelStore
from hkserve.cli.loading import LoadOptions, load_engine
from hkserve.cli.token_ids import prompt_ids
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.sampling import SamplingParams


def run_generate_ids(args) -> int:
    """Prints the generated ids comma-separated on one line (--output-ids), else their text."""
    store = ModelStore()
    info = store.info(args.model)
    ids = prompt_ids(args, store)
    tokenizer = store.tokenizer(args.model) if info.has_tokenizer else None
    if tokenizer is None and not args.output_ids:
        raise ValueError(f"model {args.model!r} has no tokenizer: use --output-ids")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=seed)
    stop_ids = tokenizer.stop_ids if tokenizer is not None else ()
    runner = InferenceRunner(load_engine(LoadOptions.from_args(args), slots=1)).start(warmup=False)
    try:
        out = [t.id for t in runner.generate(Request(ids, args.max_tokens, sampling, stop_ids))]
    finally:
        runner.stop()
    print(",".join(map(str, out)) if args.output_ids else tokenizer.decode(out), flush=True)
    return 0
