"""llama.cpp's resident memory for the same model and KV capacity, for `hkserve bench startup
--llama-gguf FILE`: the yardstick of the start-up issue (RSS after start <= 1.5x llama.cpp's).

llama-cpp-python loads the GGUF file with n_ctx = slots x max-len (the KV positions `serve` holds), answers
one short chat request, and reports VmRSS then, in a subprocess of its own so that neither process's
memory counts in the other's. llama-cpp-python is optional: without it the option is refused with a
message saying how to get it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

MISSING = "--llama-gguf needs llama-cpp-python (pip install llama-cpp-python), which this environment lacks"

# Run in the subprocess: argv = gguf path, n_ctx; prints {"loaded_kb", "after_request_kb"} as JSON.
_PROBE = """
import json, os, sys
from llama_cpp import Llama

def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=os.cpu_count(), verbose=False)
loaded = rss_kb()
llm.create_chat_completion(messages=[{"role": "user", "content": "Say hello."}], max_tokens=16)
print(json.dumps({"loaded_kb": loaded, "after_request_kb": rss_kb()}))
"""


class LlamaUnavailable(RuntimeError):
    """llama-cpp-python is not installed, or the GGUF file is not there."""


def check_available(gguf: str) -> None:
    """Refuse before any start when the comparison cannot run (checked first: a start takes minutes)."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise LlamaUnavailable(MISSING)
    if not os.path.isfile(gguf):
        raise LlamaUnavailable(f"--llama-gguf: no such file: {gguf}")


def llama_rss(gguf: str, n_ctx: int, timeout: float = 600) -> dict:
    """{"n_ctx", "rss_mib_loaded", "rss_mib_after_request"} of llama.cpp serving `gguf` in a subprocess."""
    check_available(gguf)
    cmd = [sys.executable, "-c", _PROBE, gguf, str(n_ctx)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"llama.cpp on {gguf} failed: {result.stderr[-2000:]}")
    kb = json.loads(result.stdout.strip().splitlines()[-1])
    mib = {k.replace("_kb", ""): round(v / 1024, 1) for k, v in kb.items()}
    return {"n_ctx": n_ctx, "rss_mib_loaded": mib["loaded"], "rss_mib_after_request": mib["after_request"]}
