"""`hkserve sample`: golden texts from a JSONL file, kill-and-resume, per-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from helpers import REPO, hkserve
from test_serve import tiny_home  # noqa: F401  (module-scoped fixture: a tiny GGUF model in a store)

from hkserve.cli.main import main


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_golden_cases_as_jsonl_reproduce_the_reference_texts(tmp_path, smollm2_home, golden):
    rows = [
        {"id": c["name"], **({"messages": c["messages"]} if "messages" in c else {"prompt": c["prompt"]})}
        for c in golden["cases"]
    ]
    # and two lines whose output a grammar constrains: a JSON schema, a required tool call
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    add = {"type": "function", "function": {"name": "add", "parameters": {**schema, "required": []}}}
    extra = [
        {
            "id": "json",
            "messages": [{"role": "user", "content": "A number?"}],
            "max_tokens": 24,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        },
        {
            "id": "tool",
            "messages": [{"role": "user", "content": "Add 2."}],
            "max_tokens": 40,
            "tools": [add],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        },
    ]
    write_jsonl(tmp_path / "in.jsonl", rows + extra)
    hkserve(
        "sample",
        "--input",
        str(tmp_path / "in.jsonl"),
        "--output",
        str(tmp_path / "out.jsonl"),
        "--max-tokens",
        "32",
        "--slots",
        "4",
        "--max-len",
        "256",
        "--quiet",
        home=smollm2_home,
    )
    out = read_jsonl(tmp_path / "out.jsonl")
    json_line, tool_line, out = out[-2], out[-1], out[:-2]
    assert json_line["finish_reason"] == "stop" and isinstance(json.loads(json_line["text"])["n"], int)
    assert tool_line["finish_reason"] == "tool_calls" and tool_line["tool_calls"][0]["function"]["name"] == "add"
    assert isinstance(json.loads(tool_line["tool_calls"][0]["function"]["arguments"]), dict)
    assert [o["id"] for o in out] == [c["name"] for c in golden["cases"]]
    for o, c in zip(out, golden["cases"]):
        assert o["text"] == c["text"], c["name"]
        assert o["usage"] == {
            "prompt_tokens": len(c["prompt_ids"]),
            "completion_tokens": len(c["greedy_ids"]),
            "total_tokens": len(c["prompt_ids"]) + len(c["greedy_ids"]),
        }
        assert o["finish_reason"] == ("stop" if c["greedy_ids"][-1] == 2 else "length")


def _sample_cmd(inp, out, home):
    env = {**os.environ, "HKSERVE_HOME": str(home), "PYTHONPATH": str(REPO)}
    args = [
        sys.executable,
        "-m",
        "hkserve.cli.main",
        "sample",
        "--model",
        "tiny",
        "--input",
        str(inp),
        "--output",
        str(out),
        "--max-tokens",
        "40",
        "--temperature",
        "0.9",
        "--seed",
        "11",
        "--slots",
        "2",
        "--max-len",
        "128",  # this file's runs of the tiny model share one engine shape: compiled once, then cached
        "--quiet",
    ]
    return args, env


def sample_here(args: list[str], env: dict, monkeypatch) -> int:
    """`hkserve sample` of `_sample_cmd` through the CLI's own main in this process: the tiny runs' own work
    is a fraction of a Python and JAX start. Only the run the test kills needs a process of its own."""
    monkeypatch.setenv("HKSERVE_HOME", env["HKSERVE_HOME"])
    return main(args[3:])


def test_kill_and_resume_writes_each_id_once_identical_to_an_uninterrupted_run(tmp_path, tiny_home, monkeypatch):  # noqa: F811
    rows = [{"id": i, "prompt": f"In the beginning {i}"} for i in range(40)]
    rows[5]["seed"] = 99  # a line's own sampling settings override the flags
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, rows)
    assert sample_here(*_sample_cmd(inp, tmp_path / "whole.jsonl", tiny_home), monkeypatch) == 0

    out = tmp_path / "killed.jsonl"
    args, env = _sample_cmd(inp, out, tiny_home)
    # tests/sample_gated.py holds the writer after 8 lines: the kill lands there, however fast the run.
    gated = [sys.executable, str(REPO / "tests" / "sample_gated.py"), "8", *args[3:]]
    proc = subprocess.Popen(gated, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if line == "held\n":
            break
    else:
        raise AssertionError(f"sample ended (exit {proc.wait()}) before holding after 8 lines")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    partial = out.read_text().splitlines()
    assert len(partial) == 8, len(partial)
    with open(out, "a") as f:
        f.write('{"id": 999, "text": "torn')  # what a kill in the middle of a write would leave
    assert sample_here(args, env, monkeypatch) == 0
    resumed = read_jsonl(out)
    assert [r["id"] for r in resumed] == list(range(40))
    assert resumed == read_jsonl(tmp_path / "whole.jsonl")


def test_bad_lines_get_an_error_and_the_rest_complete(tmp_path, tiny_home, monkeypatch):  # noqa: F811
    rows = [
        {"id": "ok1", "prompt": "hello"},
        "{not json",
        {"id": "noprompt"},
        {"id": "long", "prompt": "word " * 400},
        {"id": "ok2", "messages": [{"role": "user", "content": "hi"}]},
    ]
    write_jsonl(tmp_path / "in.jsonl", rows)
    monkeypatch.setenv("HKSERVE_HOME", str(tiny_home))
    inp, dest = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")
    flags = ["--max-tokens", "8", "--slots", "2", "--max-len", "128", "--quiet"]
    assert main(["sample", "--model", "tiny", "--input", inp, "--output", dest, *flags]) == 0
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [o["id"] for o in out] == ["ok1", "line 2", "noprompt", "long", "ok2"]
    assert "text" in out[0] and "text" in out[4] and "error" not in out[0]
    assert "invalid JSON" in out[1]["error"]
    assert "prompt" in out[2]["error"]
    assert "maximum context length is 128" in out[3]["error"]


# Line 2 repeats line 1's id; line 3 names itself "line 8", the implicit id of the unnamed eighth line.
REPEATED_IDS = [
    {"id": "dup", "prompt": "In the beginning"},
    {"id": "dup", "prompt": "And the earth"},
    {"id": "line 8", "prompt": "And God said"},
    *({"id": f"x{i}", "prompt": f"Let there be {i}"} for i in range(4)),
    {"prompt": "And the evening"},
    {"id": "last", "prompt": "And the morning"},
]


@pytest.fixture(scope="module")
def repeated_ids_whole(tmp_path_factory, tiny_home):  # noqa: F811
    """The input with repeated ids, and the output of one uninterrupted run."""
    tmp = tmp_path_factory.mktemp("repeated")
    write_jsonl(tmp / "in.jsonl", REPEATED_IDS)
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert sample_here(*_sample_cmd(tmp / "in.jsonl", tmp / "whole.jsonl", tiny_home), monkeypatch) == 0
    whole = read_jsonl(tmp / "whole.jsonl")
    assert [o["id"] for o in whole] == ["dup", "dup", "line 8", "x0", "x1", "x2", "x3", "line 8", "last"]
    return tmp / "in.jsonl", whole


@pytest.mark.parametrize(
    "written",
    [1, 3],  # 1: the second "dup" is still to do; 3: the explicit "line 8" is written, the implicit one is not
    ids=["repeated-id", "explicit-id-equals-implicit-id"],
)
def test_resume_after_a_repeated_id_loses_no_line(tmp_path, tiny_home, repeated_ids_whole, written, monkeypatch):  # noqa: F811
    inp, whole = repeated_ids_whole
    out = tmp_path / "out.jsonl"
    write_jsonl(out, whole[:written])  # what a kill after `written` lines leaves
    assert sample_here(*_sample_cmd(inp, out, tiny_home), monkeypatch) == 0
    assert read_jsonl(out) == whole


def test_resume_refuses_an_output_of_another_input_naming_the_line(tmp_path, tiny_home, monkeypatch, capsys):  # noqa: F811
    write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])
    out = tmp_path / "out.jsonl"
    write_jsonl(out, [{"id": "a", "text": "1"}, {"id": "c", "text": "2"}])
    before = out.read_bytes()
    assert sample_here(*_sample_cmd(tmp_path / "in.jsonl", out, tiny_home), monkeypatch) == 1
    assert 'line 2 is the result for id "c", but input line 2 has id "b"' in capsys.readouterr().err
    assert out.read_bytes() == before  # nothing written over
