"""One OpenAI request as a set of runner requests ("choices"): submit them, merge their events,
turn tokens into text (stop strings, UTF-8), logprobs and usage, in completion or chat shape."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from hkserve.api.metrics import Metrics
from hkserve.api.protocol import APIError
from hkserve.checkpoint.tokenizer import Tokenizer
from hkserve.engine.runner import Event, Overloaded, Request, RequestStream
from hkserve.engine.textstream import TextStream


@dataclass
class Choice:
    index: int
    stream: RequestStream
    text: TextStream
    prompt_len: int
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)  # (token id, logprob, [(id, logprob)]) per delivered token
    last_token_at: float | None = None


@dataclass
class Update:
    """What one event changed in one choice: new text, new logprob entries, and maybe the finish."""

    choice: Choice
    text: str
    logprobs: list
    finish_reason: str | None


class Generation:
    """Submits the choices of one HTTP request and yields their updates as the runner produces them."""

    def __init__(self, runner, tokenizer: Tokenizer, metrics: Metrics, kind: str):
        self.runner, self.tokenizer, self.metrics = runner, tokenizer, metrics
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.started = time.monotonic()
        self.choices: list[Choice] = []
        self.prompt_tokens = 0

    def submit(
        self,
        prompts: list[list[int]],
        n: int,
        max_tokens: list[int],
        sampling: dict,
        seed: int,
        stop: list[str],
        logprobs: int,
        ignore_eos: bool = False,
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            for p, prompt_ids in enumerate(prompts):
                for j in range(n):
                    index = p * n + j
                    stop_ids = () if ignore_eos else self.tokenizer.stop_ids
                    request = Request(
                        list(prompt_ids),
                        max_tokens[p],
                        {**sampling, "seed": (seed + index) % 2**32},
                        stop_ids,
                        logprobs,
                    )
                    stream = self.runner.submit(request, loop)
                    self.choices.append(Choice(index, stream, TextStream(self.tokenizer, stop), len(prompt_ids)))
        except Overloaded as e:
            self.cancel()
            raise APIError(
                429, f"the server is overloaded: {e}", "rate_limit_exceeded", headers={"Retry-After": "1"}
            ) from e
        except ValueError as e:  # the runner's own validation (context, vocabulary, logprobs)
            self.cancel()
            raise APIError(400, str(e)) from e
        self.prompt_tokens = sum(len(p) for p in prompts)  # counted once per prompt, whatever n is
        self.metrics.prompt_tokens.inc(self.prompt_tokens * n)

    def cancel(self) -> None:
        for c in self.choices:
            if c.finish_reason is None:
                self.runner.cancel(c.stream.request.id)

    async def updates(self) -> AsyncIterator[Update]:
        """Updates of all choices, interleaved as they come; ends when every choice finished."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice):
            async for event in choice.stream:
                await merged.put((choice, event))

        tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        try:
            remaining = len(self.choices)
            while remaining:
                choice, event = await merged.get()
                update = self._apply(choice, event)
                if update is not None:
                    yield update
                if event.finish_reason is not None:
                    remaining -= 1
        finally:
            for t in tasks:
                t.cancel()
            self.cancel()  # no-op unless the consumer went away early

    def _apply(self, choice: Choice, event: Event) -> Update | None:
        if event.error:
            raise APIError(500, f"generation failed: {event.error}", "server_error")
        if choice.finish_reason is not None:
            return None  # finished by a stop string: the rest is the engine catching up
        now = time.monotonic()
        if event.token is not None:
            token = event.token
            if choice.tokens == 0:
                self.metrics.ttft.observe(now - self.started)
                if choice.stream.admitted_at is not None:
                    self.metrics.queue_time.observe(
                        max(0.0, choice.stream.admitted_at - choice.stream.request.submitted_at)
                    )
            elif choice.last_token_at is not None:
                self.metrics.itl.observe(now - choice.last_token_at)
            choice.last_token_at = now
            choice.tokens += 1
            self.metrics.generation_tokens.inc()
            if token.id in choice.stream.request.stop_ids:
                return None  # EOS: no text; the finish event follows
            piece = choice.text.add(token.id)
            entry = [(token.id, token.logprob, token.top)]
            if piece.stopped:
                self._finish(choice, "stop")
                self.runner.cancel(choice.stream.request.id)
                return Update(choice, piece.text, entry, "stop")
            return Update(choice, piece.text, entry, None)
        reason = {"stop": "stop", "length": "length"}.get(event.finish_reason, "stop")
        self._finish(choice, reason)
        return Update(choice, choice.text.finish(), [], reason)

    def _finish(self, choice: Choice, reason: str) -> None:
        choice.finish_reason = reason
        self.metrics.requests.labels(finish_reason=reason).inc()
        self.metrics.e2e.observe(time.monotonic() - self.started)

    def usage(self) -> dict:
        completion = sum(c.tokens for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }
