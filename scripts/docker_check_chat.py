"""scripts/docker-check.sh's request: the golden SmolLM2 chat case through the openai client, greedy, against
the server in the image; its reply must be the reference's text exactly (../shared/fixtures, as
tests/test_api_live.py checks it in process)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import openai

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "smollm2_golden.json"
MODEL = "smollm2-135m-instruct"


def main(base_url: str) -> int:
    if not GOLDEN.is_file():
        print(f"docker-check: the golden fixture {GOLDEN} is missing", file=sys.stderr)
        return 1
    case = next(c for c in json.loads(GOLDEN.read_text())["cases"] if "messages" in c)
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model=MODEL, messages=case["messages"], temperature=0, max_tokens=32)
    text = reply.choices[0].message.content
    print(f"   {case['messages'][-1]['content']!r} -> {text!r} ({reply.choices[0].finish_reason})", file=sys.stderr)
    if text != case["text"] or reply.choices[0].finish_reason != "stop":
        print(f"docker-check: the golden reply is {case['text']!r}", file=sys.stderr)
        return 1
    print("   = the golden reply", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
