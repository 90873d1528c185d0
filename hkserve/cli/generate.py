"""`hkserve generate`: complete one prompt and print the text."""

from __future__ import annotations

import os
import sys
import time

from hkserve.cli.generate_ids import run_generate_ids
from hkserve.cli.loading import LoadOptions, load_runner
from hkserve.engine.completion import Completion
from hkserve.engine.requests import Request
from hkserve.model.sampling import SamplingParams


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_generate(args) -> int:
    """Complete one prompt, printing the text as it comes (stdout) and the timings (stderr)."""
    if args.ids is not None or args.output_ids:
        return run_generate_ids(args)
    if args.prompt is None:
        raise ValueError("give a PROMPT or --ids")
    started = time.perf_counter()
    tokenizer, runner, _ = load_runner(LoadOptions.from_args(args), slots=1)
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system is not None else []
        prompt_ids = tokenizer.encode_chat(messages + [{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=seed)
    loaded = time.perf_counter()

    arrivals = []  # token arrival times; the first includes the prefill and step compiles
    try:
        stream = runner.submit(Request(prompt_ids, args.max_tokens, sampling, tokenizer.stop_ids))
        for delta in Completion(stream, tokenizer, runner.cancel):
            if delta.token is not None:
                arrivals.append(time.perf_counter())
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    finally:
        runner.stop()
    sys.stdout.write("\n")
    sys.stdout.flush()
    timing = (
        f"load {loaded - started:.2f}s, first token {arrivals[0] - loaded:.2f}s (prefill of "
        f"{len(prompt_ids)} tokens and the compiles)"
    )
    if len(arrivals) > 2:  # steady decode, from the second step on
        rate = (len(arrivals) - 2) / (arrivals[-1] - arrivals[1])
        timing += f", then {rate:.1f} tok/s"
    _log(f"{timing} ({len(arrivals)} tokens)")
    return 0
