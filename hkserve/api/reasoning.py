"""Reasoning models' thinking, split from their answer: `<think> ... </think>` before the answer becomes
the reply's `reasoning_content`, the rest its `content` (as vLLM, SGLang and llama.cpp return it).

Two families write it differently:
- deepseek_r1: the chat template opens `<think>` in the prompt, so the output starts inside the
  reasoning and ends it with `</think>` (some versions repeat `<think>` first: it is dropped);
- qwen3: the output may or may not hold `<think>...</think>` (`enable_thinking: false` renders an
  empty one in the prompt), so only an output that starts with `<think>` has reasoning.

ReasoningParser is fed the output's text as it comes (whole replies feed it all at once), holding back
text that may still become a tag, so a streamed reply splits exactly as the whole one. `choose` picks
the parser (`--reasoning-parser`), `answer_only` makes a request's grammar constrain the answer alone.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from hkserve.api.tools import held
from hkserve.engine.constrained import JSON_OPTIONS, GrammarError, GrammarSpec

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")
CHOICES = ("auto", "none", *PARSERS)


@dataclass
class ReasoningParser:
    starts_inside: bool  # deepseek_r1: the prompt opened <think>
    _buffer: str = ""
    _state: str = "start"  # start | reasoning | content
    _strip: bool = False  # drop the newlines that follow </think>
    reasoning_chars: int = 0  # output characters up to and including </think> (counted as reasoning)
    _seen: int = 0  # output characters fed so far

    @classmethod
    def named(cls, name: str) -> ReasoningParser:
        return cls(starts_inside=name == "deepseek_r1")

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The (reasoning, content) text that `text` released."""
        self._buffer += text
        self._seen += len(text)
        reasoning = content = ""
        if self._state == "start":
            head = self._buffer.lstrip()
            if head.startswith(START):
                self._buffer, self._state = head[len(START) :], "reasoning"
            elif START.startswith(head) and not final:
                return "", ""  # may yet be <think>
            else:
                self._state = "reasoning" if self.starts_inside else "content"
        if self._state == "reasoning":
            at = self._buffer.find(END)
            if at < 0:
                keep = 0 if final else held(self._buffer, END)
                reasoning = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(reasoning) :]
                self.reasoning_chars = self._seen - len(self._buffer)
                return reasoning, ""
            reasoning, self._buffer = self._buffer[:at], self._buffer[at + len(END) :]
            self._state, self._strip = "content", True
            self.reasoning_chars = self._seen - len(self._buffer)
        if self._strip:
            self._buffer = self._buffer.lstrip("\n")
            if not self._buffer and not final:
                return reasoning, ""
            self._strip = False
        content, self._buffer = self._buffer, ""
        return reasoning, content


def detect(template: str | None, vocab_has_think: bool) -> str | None:
    """The parser a model's chat template and vocabulary call for (`--reasoning-parser auto`), or None.
    A template that writes `<think>` after the generation prompt opens the reasoning itself (DeepSeek-R1's
    distills); one that reads `enable_thinking` or strips past thinking, or a vocabulary with a `<think>`
    token, lets the model open it (Qwen3, SmolLM3)."""
    template = template or ""
    if "add_generation_prompt" in template and _opens_think(template):
        return "deepseek_r1"
    if "enable_thinking" in template or END in template or vocab_has_think:
        return "qwen3"
    return None


def _opens_think(template: str) -> bool:
    """Whether the template's generation prompt opens `<think>` without closing it (DeepSeek-R1's
    `<｜Assistant｜><think>\\n`; Qwen3's writes a closed, empty one only when thinking is off)."""
    tail = template[template.rfind("add_generation_prompt") :]
    return START in tail and END not in tail


def choose(name: str, template: str | None, vocab_has_think: bool) -> str | None:
    """The parser `--reasoning-parser` names: auto detects, none is off."""
    if name not in CHOICES:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(CHOICES)}, got {name!r}")
    if name == "auto":
        return detect(template, vocab_has_think)
    return None if name == "none" else name


THINKING = r"/(.|\n)*<\/think>\n*/ & ~/(.|\n)*<\/think>(.|\n)*<\/think>(.|\n)*/"  # up to the first </think>


def answer_only(spec: GrammarSpec | None, parser: str | None) -> GrammarSpec | None:
    """`spec` applied to the answer alone: the reasoning before it is free (deepseek_r1's always comes
    first, qwen3's may). A Lark grammar's `start` rule becomes the answer's."""
    if spec is None or parser is None:
        return spec
    kind, text = spec
    if kind in ("json_schema", "json_object"):
        schema = json.loads(text) if kind == "json_schema" else {"type": "object"}
        answer = [f"answer: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS}, ensure_ascii=False)}"]
    elif kind == "regex":
        answer = [f"answer: /{text.replace('/', chr(92) + '/')}/"]
    elif kind == "choice":
        answer = ["answer: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text))]
    else:
        if not re.search(r"^start\s*:", text, re.M):
            raise GrammarError("a grammar for a reasoning model needs a `start:` rule (it becomes the answer's)")
        answer = [re.sub(r"^start(\s*):", r"answer\1:", text, flags=re.M)]
    opening = "THINKING" if parser == "deepseek_r1" else '("<think>" THINKING)?'
    head = [f"start: {opening} answer", f"THINKING: {THINKING}"]
    return GrammarSpec("lark", "\n".join(head + answer) + "\n")
