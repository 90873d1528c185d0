"""`hkserve sample`: completions for a JSONL file of prompts, every slot kept busy.

Input lines: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]}, optionally with their own
max_tokens / stop / ignore_eos, any field of SamplingParams (temperature, top_p, top_k, min_p, seed,
penalties, logit_bias), and what the output must match as in the HTTP API: response_format,
structured_outputs, or (with messages) tools / tool_choice / parallel_tool_calls (in the model's call
format, --tool-call-parser, read as the chat route reads it). Output lines, one per
input line and in input order: {"id", "text", "finish_reason", "usage"} (plus "tool_calls" when the
line has tools and the model called them) or {"id", "error"}.

Resumable: results are written strictly in input order, one whole line per write, so after a kill the
output is a prefix of the final file; a re-run drops a torn last line and continues after the lines
already written. Resuming goes by position, so ids need not be unique (two lines with the same id, or
an explicit id "line 8" beside an unnamed eighth line, both get their result); each written line's id
must still be its input line's, else the output belongs to another input and the run is refused. Seeds
are per line (its own, or --seed + line index), so a resumed run writes exactly what an uninterrupted
one would.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from hkserve.api import tool_parsers
from hkserve.api.reply import Markers, ReplyParser
from hkserve.api.structured import output_spec
from hkserve.api.tools import render_messages
from hkserve.cli.loading import (
    LoadOptions,
    add_kv_arguments,
    add_prefix_cache_argument,
    add_variant_arguments,
    load_runner,
)
from hkserve.engine.completion import Completion, GenerationFailed
from hkserve.engine.constrained import GrammarCompiler
from hkserve.engine.requests import Overloaded, Request
from hkserve.engine.state import check_context
from hkserve.model.sampling import SamplingParams


def add_arguments(p) -> None:
    p.add_argument("--input", required=True, help="JSONL prompts")
    p.add_argument("--output", required=True, help="JSONL results (resumed if it exists)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--mesh", default=None)
    add_variant_arguments(p)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tool-call-parser",
        choices=tool_parsers.CHOICES,
        default="auto",
        help="the format the model writes tool calls in, as `hkserve serve` (auto: from the chat template)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_prefix_cache_argument(p)
    add_kv_arguments(p)


def line_id(index: int, record):
    """Output id of an input line: its id, or its line number when it has none."""
    if isinstance(record, dict) and record.get("id") is not None:
        return record["id"]
    return f"line {index + 1}"


def _parse(raw: str):
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return None


def resume_point(path: Path, ids: list) -> int:
    """How many input lines the output already holds (their results are its lines, in input order);
    a torn (unterminated) last line is cut off first. Raises ValueError, naming the line, when a
    written id is not its input line's: that output belongs to another input."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1
    written = data[:cut].decode().splitlines()
    if len(written) > len(ids):
        raise ValueError(f"{path} has {len(written)} results but the input only {len(ids)} lines: use another --output")
    for n, (line, want) in enumerate(zip(written, ids), 1):
        record = _parse(line)
        got = record.get("id") if isinstance(record, dict) else None
        if json.dumps(got) != json.dumps(want):
            raise ValueError(
                f"{path} line {n} is the result for id {json.dumps(got)}, but input line {n} has id "
                f"{json.dumps(want)}: the output belongs to another input (use another --output)"
            )
    if cut < len(data):
        with open(path, "r+b") as f:
            f.truncate(cut)
    return len(written)


class Job:
    """One input line: its request, or why it cannot run."""

    def __init__(self, index: int, raw: str, args, tokenizer, max_len: int, compiler=None):
        self.index, self.error, self.request, self.stop = index, None, None, []
        self.compiler, self.tools, self.markers = compiler, None, Markers()
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as e:
            record, self.error = None, f"invalid JSON: {e}"
        self.id = line_id(index, record)
        if self.error:
            return
        try:
            self._build(record, args, tokenizer, max_len)
        except (ValueError, TypeError, KeyError) as e:
            self.error = str(e)

    def _build(self, record, args, tokenizer, max_len):
        if not isinstance(record, dict):
            raise ValueError("each line must be a JSON object")
        if isinstance(record.get("messages"), list):
            fmt = tool_parsers.choose(args.tool_call_parser, tokenizer.chat_template)
            choice, parallel = record.get("tool_choice"), record.get("parallel_tool_calls")
            tools = tool_parsers.model_tools(tokenizer, fmt, record.get("tools"), choice, parallel)
            self.tools = tools if tools is not None and tools.active else None
            self.markers = Markers.of(tokenizer, self.tools)  # kept for the parser, hidden from the text
            messages, defs = render_messages(record["messages"], tools, tokenizer.template_takes_tools)
            prompt_ids = tokenizer.encode(tokenizer.render_chat(messages, tools=defs), add_bos=False)
        elif isinstance(record.get("prompt"), str):
            prompt_ids = tokenizer.encode(record["prompt"])
        else:
            raise ValueError('the line needs a string "prompt" or a "messages" list')
        max_tokens = int(record.get("max_tokens", args.max_tokens))
        check_context(max_len, len(prompt_ids), max_tokens)
        flags = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=(args.seed + self.index) % 2**32)
        sampling = flags.with_overrides(record)
        stop = record.get("stop") or []
        self.stop = [stop] if isinstance(stop, str) else list(stop)
        stop_ids = () if record.get("ignore_eos") else tokenizer.stop_ids
        spec = output_spec(record.get("response_format"), record.get("structured_outputs"))
        if spec is not None and self.tools is not None:
            raise ValueError("a line constrained by tools cannot also set a response format")
        spec = spec or (self.tools.grammar() if self.tools is not None else None)
        grammar = self.compiler.compile(spec) if spec is not None else None
        self.request = Request(prompt_ids, max_tokens, sampling, stop_ids, grammar=grammar)


async def _complete(job: Job, runner, tokenizer) -> dict:
    if job.error:
        return {"id": job.id, "error": job.error}
    while True:
        try:
            stream = runner.submit(job.request, asyncio.get_running_loop())
            break
        except Overloaded:
            await asyncio.sleep(0.01)
        except ValueError as e:
            return {"id": job.id, "error": str(e)}
    completion = Completion(stream, tokenizer, runner.cancel, job.stop, job.markers.ids)
    try:
        async for _ in completion:
            pass
    except GenerationFailed as e:
        return {"id": job.id, "error": str(e)}
    result = {"id": job.id, "text": completion.text, "finish_reason": completion.finish_reason}
    if job.tools is not None:
        parser = ReplyParser(None, job.tools, job.markers)
        result["text"] = parser.feed(completion.text, final=True).content
        if parser.calls:
            result["tool_calls"] = parser.calls
            result["finish_reason"] = "tool_calls" if completion.finish_reason == "stop" else completion.finish_reason
    return {**result, "usage": completion.usage()}


def input_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


async def sample_file(runner, tokenizer, max_len: int, args, lines: list[str], start: int) -> dict:
    """Run the input lines from `start` on (those before are in the output); returns counts and timing."""
    out_path = Path(args.output)
    compiler = GrammarCompiler(tokenizer, runner.engine.model.config.vocab_size)
    jobs = [Job(i, raw, args, tokenizer, max_len, compiler) for i, raw in enumerate(lines)]
    todo = jobs[start:]
    window = asyncio.Semaphore(runner.engine.slots + runner.max_queue // 2)  # keep every slot busy, queue bounded
    results: dict[int, dict] = {}
    next_to_write = 0
    started, generated = time.perf_counter(), 0
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), unit="req", disable=args.quiet, file=sys.stderr)
    with open(out_path, "a") as out:

        async def run(position: int, job: Job):
            nonlocal next_to_write, generated
            async with window:
                results[position] = await _complete(job, runner, tokenizer)
            generated += results[position].get("usage", {}).get("completion_tokens", 0)
            while next_to_write in results:  # write the finished prefix, in input order, whole lines
                out.write(json.dumps(results.pop(next_to_write)) + "\n")
                out.flush()
                next_to_write += 1
                bar.update(1)
            bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - started):.1f}")

        await asyncio.gather(*(run(i, job) for i, job in enumerate(todo)))
        os.fsync(out.fileno())
    bar.close()
    elapsed = time.perf_counter() - started
    return {"requests": len(todo), "skipped": len(jobs) - len(todo), "seconds": elapsed, "tokens": generated}


def run(args) -> int:
    lines = input_lines(Path(args.input))
    start = resume_point(Path(args.output), [line_id(i, _parse(raw)) for i, raw in enumerate(lines)])
    tokenizer, runner, max_len = load_runner(
        LoadOptions.from_args(args), slots=args.slots, start=False, max_queue=max(64, 2 * args.slots)
    )
    runner.start(warmup=True)
    try:
        stats = asyncio.run(sample_file(runner, tokenizer, max_len, args, lines, start))
    finally:
        runner.stop()
    rate = stats["requests"] / stats["seconds"] if stats["seconds"] else 0.0
    print(
        f"{stats['requests']} requests ({stats['skipped']} already done) in {stats['seconds']:.1f}s: "
        f"{rate:.2f} req/s, {stats['tokens'] / max(stats['seconds'], 1e-9):.1f} output tok/s",
        file=sys.stderr,
    )
    return 0
