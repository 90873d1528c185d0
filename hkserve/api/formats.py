"""OpenAI response shapes: completion and chat, whole bodies and stream chunks (with usage)."""

from __future__ import annotations

from hkserve.api.generation import Generation, Update
from hkserve.checkpoint.tokenizer import Tokenizer
from hkserve.engine.engine import Token


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

    def chunks(self, gen: Generation, update) -> list[dict]:
        """Stream chunks for the start (update None), one update, or the end (update "usage")."""
        if update is None:
            return self._head(gen)
        if update == "usage":
            if not self.include_usage:
                return []
            return [self._envelope(gen, self.object_chunk, [], gen.usage(), True)]
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
        self.offsets: dict[int, int] = {}

    def _logprobs(self, index: int, entries: list[Token]) -> dict | None:
        if self.body.logprobs is None:  # 0 still means: the chosen tokens' logprobs
            return None
        tokens, lps, tops, offsets = [], [], [], []
        for token_id, logprob, top in entries:
            text = self._token_str(token_id)
            offsets.append(self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + len(text)
            tokens.append(text)
            lps.append(logprob)
            tops.append({self._token_str(i): lp for i, lp in top})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _prefix(self, index: int) -> str:
        return self.echo[index // self.body.n] if self.echo else ""

    def _head(self, gen: Generation) -> list[dict]:
        if not self.echo:
            return []
        return [
            self._envelope(
                gen,
                self.object_chunk,
                [{"index": c.index, "text": self._prefix(c.index), "logprobs": None, "finish_reason": None}],
            )
            for c in gen.choices
        ]

    def _chunk_choice(self, u: Update) -> dict | None:
        logprobs = self._logprobs(u.choice.index, u.logprobs) if u.logprobs else None
        if not u.text and u.finish_reason is None and logprobs is None:
            return None
        return {"index": u.choice.index, "text": u.text, "logprobs": logprobs, "finish_reason": u.finish_reason}

    def final(self, gen: Generation, per_choice: list[list[Update]]) -> dict:
        choices = []
        for c, updates in zip(gen.choices, per_choice):
            entries = [e for u in updates for e in u.logprobs]
            choices.append(
                {
                    "index": c.index,
                    "text": self._prefix(c.index) + "".join(u.text for u in updates),
                    "logprobs": self._logprobs(c.index, entries),
                    "finish_reason": c.finish_reason,
                }
            )
        return {**self._envelope(gen, self.object_final, choices), "usage": gen.usage()}


class ChatFormat(_Format):
    object_final = "chat.completion"
    object_chunk = "chat.completion.chunk"

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
        if not u.text and u.finish_reason is None and logprobs is None:
            return None
        delta = {"content": u.text} if u.text else {}
        return {"index": u.choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": u.finish_reason}

    def final(self, gen: Generation, per_choice: list[list[Update]]) -> dict:
        choices = []
        for c, updates in zip(gen.choices, per_choice):
            message = {"role": "assistant", "content": "".join(u.text for u in updates), "refusal": None}
            entries = [e for u in updates for e in u.logprobs]
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(entries),
                    "finish_reason": c.finish_reason,
                }
            )
        return {**self._envelope(gen, self.object_final, choices), "usage": gen.usage()}
