"""`hkserve bench serve` end to end on a tiny store, against a server made to refuse: a long prompt every
5 ms beside the clients, 2 slots, a queue of 16. The command completes, each run's row reaches stderr in
the sides' alternating order, and the JSON has every key, refusals counted (tests/test_bench_serve_*.py
check the same properties in seconds against the app over a scripted runner)."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import hkserve, require_fixtures
from test_bench import SERVE_KEYS
from test_gguf import train_sentencepiece

from hkserve.checkpoint.convert import convert
from hkserve.checkpoint.store import ModelStore


@pytest.mark.slow  # a server and a runner compiled for the tiny model, 4 runs of 2 s: ~1.5 min on 2 busy cores
def test_bench_serve_completes_against_an_overloaded_server_and_prints_each_run(tmp_path):
    hf = tmp_path / "tiny-llama-untied"
    shutil.copytree(require_fixtures() / "hf" / "tiny-llama-untied", hf)
    (hf / "tokenizer.model").write_bytes(train_sentencepiece(256).serialized_model_proto())  # the model's 256 ids
    convert(hf, "tiny", ModelStore(tmp_path / "home"), progress=False)
    flags = "--model tiny --json --max-len 256 --slots 2 --concurrency 1,2 --repeats 2 --kv-layout paged"
    flags += " --kv-cache-mb 4 --lengths chat --long-prompt-every 0.005 --duration-s 2"
    result = hkserve("bench", "serve", *flags.split(), home=tmp_path / "home")
    report = json.loads(result.stdout.splitlines()[-1])
    for side in (report, report["runner"]):
        for c in ("1", "2"):
            row = side[c]
            assert set(row) == SERVE_KEYS and row["served"] >= 1 and row["long_prompts"] >= 1
            assert row["errors_by_status"].get("429", 0) >= row["rejected"]  # summed over 2 runs; the median
            assert set(row["errors_by_status"]) | set(row["long_errors_by_status"]) <= {"429", "connection_error"}
    assert report["settings"]["duration_s"] == 2.0 and report["settings"]["retries"] == 2
    rows = [line.split(":")[0].split() for line in result.stderr.splitlines() if line.endswith("/2)")]
    order = [["http", "concurrency", "1"], ["runner", "concurrency", "1"]]
    order = order + order[::-1]
    assert rows == order + [[name, word, "2"] for name, word, _ in order]
