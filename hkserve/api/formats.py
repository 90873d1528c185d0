"""OpenAI response shapes: completion and chat, whole bodies and stream chunks (with usage)."""

from __future__ import annotations

from hkserve.api.generation import Generation, Update
from hkserve.api.reply import Markers, ReplyParser
from hkserve.api.tools import Tools
from hkserve.checkpoint.tokenizer import Tokenizer
from hkserve.engine.outputs import ScoredToken, Token


class _Format:
    object_final = ""
    object_chunk = ""
    null_usage_in_chunks = True  # chat chunks carry "usage": null until the last (completion chunks omit it)

    def __init__(self, tokenizer: Tokenizer, model: str, body):
        self.tokenizer, self.model, self.body = tokenizer, model, body
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def _envelope(self, gen: Generation, obj: str, choices: list, usage=None, with_usage: bool = False) -> dict:
        out = {"id": gen.id, "object": obj, "created": gen.created, "model": self.model, "choices": choices}
        if with_usage:
            out["usage"] = usage
        return out

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    def _usage(self, gen: Generation) -> dict:
        return gen.usage()

    def chunks(self, gen: Generation, update) -> list[dict]:
        """Stream chunks for the start (update None), one update, or the end (update "usage")."""
        if update is None:
            return self._head(gen)
        if update == "usage":
            if not self.include_usage:
                return []
            return [self._envelope(gen, self.object_chunk, [], self._usage(gen), True)]
        choice = self._chunk_choice(update)
        if choice is None:
            return []
        return [
            self._envelope(gen, self.object_chunk, [choice], None, self.include_usage and self.null_usage_in_chunks)
        ]


class CompletionFormat(_Format):
    object_final = object_chunk = "text_completion"
    null_usage_in_chunks = False

    def __init__(self, tokenizer: Tokenizer, model: str, body, echo: list[str] | None):
        super().__init__(tokenizer, model, body)
        self.echo = echo  # prompt texts, when echo is on
        self.scored = body.prompt_scoring() is not None  # the prompt comes back scored, as a first update
        self.offsets: dict[int, int] = {}

    def _logprobs(self, index: int, entries: list[Token]) -> dict | None:
        if self.body.logprobs is None:  # 0 still means: the chosen tokens' logprobs
            return None
        tokens, lps, tops, offsets = [], [], [], []
        for token in entries:
            text = self._token_str(token.id)
            offsets.append(self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + len(text)
            tokens.append(text)
            lps.append(token.logprob)
            tops.append(None if token.logprob is None else {self._token_str(i): lp for i, lp in token.top})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _echoed(self, u: Update) -> list[Token]:
        """The echoed prompt's logprob entries (OpenAI's legacy echo): the first token's are null."""
        if not self.echo or self.body.logprobs is None:
            return []
        first = Token(u.choice.completion.request.prompt_ids[0], None, [])
        return [first] + [Token(t.id, t.logprob, t.top[: self.body.logprobs]) for t in u.prompt]

    def _prompt_logprobs(self, scored: list[ScoredToken]) -> list[dict | None]:
        """vLLM's prompt_logprobs: None for the first token, then {id: {logprob, rank, decoded_token}}
        for the token and the most likely ones at its position."""
        out: list[dict | None] = [None]
        for t in scored:
            ranked = {t.id: (t.logprob, t.rank)}
            for rank, (i, lp) in enumerate(t.top[: self.body.prompt_logprobs], 1):
                ranked.setdefault(i, (lp, rank))
            out.append(
                {
                    str(i): {"logprob": lp, "rank": r, "decoded_token": self._token_str(i)}
                    for i, (lp, r) in ranked.items()
                }
            )
        return out

    def _prefix(self, index: int) -> str:
        return self.echo[index // self.body.n] if self.echo else ""

    def _head(self, gen: Generation) -> list[dict]:
        if not self.echo or self.scored:  # a scored prompt is echoed with its logprobs, once they come
            return []
        return [
            self._envelope(
                gen,
                self.object_chunk,
                [{"index": c.index, "text": self._prefix(c.index), "logprobs": None, "finish_reason": None}],
            )
            for c in gen.choices
        ]

    def _with_prompt(self, choice: dict, u: Update | None) -> dict:
        """vLLM's prompt_logprobs added to a choice, when asked for (`u`: the scored prompt's update)."""
        if self.body.prompt_logprobs is None:
            return choice
        return {**choice, "prompt_logprobs": self._prompt_logprobs(u.prompt) if u else None}

    def _chunk_choice(self, u: Update) -> dict | None:
        index = u.choice.index
        if u.prompt is not None:
            echoed = self._echoed(u)
            logprobs = self._logprobs(index, echoed) if echoed else None
            choice = {"index": index, "text": self._prefix(index), "logprobs": logprobs, "finish_reason": None}
            return self._with_prompt(choice, u)
        logprobs = self._logprobs(index, u.logprobs) if u.logprobs else None
        if not u.text and u.finish_reason is None and logprobs is None:
            return None
        return {"index": index, "text": u.text, "logprobs": logprobs, "finish_reason": u.finish_reason}

    def final(self, gen: Generation, per_choice: list[list[Update]]) -> dict:
        choices = []
        for c, updates in zip(gen.choices, per_choice):
            prompt = next((u for u in updates if u.prompt is not None), None)
            entries = (self._echoed(prompt) if prompt else []) + [e for u in updates for e in u.logprobs]
            choice = {
                "index": c.index,
                "text": self._prefix(c.index) + "".join(u.text for u in updates),
                "logprobs": self._logprobs(c.index, entries),
                "finish_reason": c.finish_reason,
            }
            choices.append(self._with_prompt(choice, prompt))
        return {**self._envelope(gen, self.object_final, choices), "usage": gen.usage()}


class ChatFormat(_Format):
    """Chat replies, split by ReplyParser: `reasoning_content` (when a reasoning parser is on),
    `content` and `tool_calls` (when tools are)."""

    object_final = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(
        self, tokenizer: Tokenizer, model: str, body, tools: Tools | None = None, reasoning: str | None = None
    ):
        super().__init__(tokenizer, model, body)
        self.tools = tools if tools is not None and tools.active else None
        self.reasoning = reasoning  # the reasoning parser's name, or None
        self.markers = Markers.of(tokenizer, self.tools, reasoning)  # the choices' Completions keep their ids
        self.parsers: dict[int, ReplyParser] = {}  # per choice

    def _parser(self, index: int) -> ReplyParser:
        return self.parsers.setdefault(index, ReplyParser(self.reasoning, self.tools, self.markers))

    @staticmethod
    def _reason(reason: str | None, parser: ReplyParser) -> str | None:
        return "tool_calls" if reason == "stop" and parser.calls else reason

    def _usage(self, gen: Generation) -> dict:
        """OpenAI's usage, with completion_tokens_details.reasoning_tokens when reasoning is split."""
        out = gen.usage()
        if self.reasoning is not None:
            encode = self.tokenizer.encode
            tokens = sum(
                len(encode(p.reasoning_text, add_bos=False)) for p in self.parsers.values() if p.reasoning_text
            )
            out["completion_tokens_details"] = {"reasoning_tokens": tokens}
        return out

    def _entry(self, token_id: int, logprob: float, top: list) -> dict:
        def one(i: int, lp: float) -> dict:
            raw = self.tokenizer.token_bytes(i)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(raw)}

        return {**one(token_id, logprob), "top_logprobs": [one(i, lp) for i, lp in top]}

    def _logprobs(self, entries: list[Token]) -> dict | None:
        if not self.body.logprobs:
            return None
        return {"content": [self._entry(*e) for e in entries], "refusal": None}

    def _head(self, gen: Generation) -> list[dict]:
        return [
            self._envelope(
                gen,
                self.object_chunk,
                [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                None,
                self.include_usage,
            )
            for c in gen.choices
        ]

    def _chunk_choice(self, u: Update) -> dict | None:
        logprobs = self._logprobs(u.logprobs) if u.logprobs else None
        parser = self._parser(u.choice.index)
        parts = parser.feed(u.text, final=u.finish_reason is not None)
        if not parts.reasoning and not parts.content and not parts.calls and u.finish_reason is None and not logprobs:
            return None
        delta: dict = {"reasoning_content": parts.reasoning} if parts.reasoning else {}
        if parts.content:
            delta["content"] = parts.content
        if parts.calls:
            delta["tool_calls"] = [c.openai() for c in parts.calls]
        reason = self._reason(u.finish_reason, parser)
        return {"index": u.choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def final(self, gen: Generation, per_choice: list[list[Update]]) -> dict:
        choices = []
        for c, updates in zip(gen.choices, per_choice):
            parser = self._parser(c.index)
            parts = parser.feed("".join(u.text for u in updates), final=True)
            message = {"role": "assistant", "content": parts.content, "refusal": None}
            if self.reasoning is not None:
                message["reasoning_content"] = parts.reasoning or None
            if parser.calls:
                message["content"] = parts.content if parts.content.strip() else None
                message["tool_calls"] = parser.calls
            entries = [e for u in updates for e in u.logprobs]
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(entries),
                    "finish_reason": self._reason(c.finish_reason, parser),
                }
            )
        return {**self._envelope(gen, self.object_final, choices), "usage": self._usage(gen)}
