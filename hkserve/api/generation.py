"""One OpenAI request as a set of runner requests ("choices"), each read through a Completion (text,
stop strings, usage): submit them, merge their updates, and count them in the metrics."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from hkserve.api.metrics import Metrics
from hkserve.api.protocol import APIError, domain_error
from hkserve.checkpoint.tokenizer import Tokenizer
from hkserve.engine.completion import Completion, GenerationFailed, usage
from hkserve.engine.constrained import Grammar
from hkserve.engine.outputs import ScoredToken, Token
from hkserve.engine.requests import Event, Overloaded, Request
from hkserve.model.sampling import SamplingParams

log = logging.getLogger("hkserve.api")
OPENAI_FINISH = {"stop": "stop", "length": "length"}  # OpenAI has no "cancelled": a stopped server ends with "stop"


@dataclass
class Choice:
    index: int
    completion: Completion
    finish_reason: str | None = None  # as OpenAI names it
    last_token_at: float | None = None


@dataclass
class Update:
    """What one event changed in one choice: new text, new logprob entries, and maybe the finish; or
    the scored prompt."""

    choice: Choice
    text: str
    logprobs: list[Token]
    finish_reason: str | None
    prompt: list[ScoredToken] | None = None


class Generation:
    """Submits the choices of one HTTP request and yields their updates as the runner produces them,
    adding what only HTTP needs: metrics, OpenAI's finish reasons, domain errors as APIError.

    A consumer that falls more than `max_backlog` updates behind (a client not reading its stream) has
    its choices cancelled, so their slots free and the updates held for it stop growing."""

    def __init__(self, runner, tokenizer: Tokenizer, metrics: Metrics, kind: str, max_backlog: int = 1024):
        self.runner, self.tokenizer, self.metrics = runner, tokenizer, metrics
        self.max_backlog = max_backlog
        self.fell_behind = False
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.started = time.monotonic()
        self.choices: list[Choice] = []
        self.prompt_tokens = 0
        self.n = 1  # choices per prompt

    def submit(
        self,
        prompts: list[list[int]],
        n: int,
        max_tokens: list[int],
        sampling: SamplingParams,
        stop: list[str],
        logprobs: int,
        ignore_eos: bool = False,
        prompt_logprobs: int | None = None,
        grammar: Grammar | None = None,
        keep: frozenset[int] = frozenset(),
    ) -> None:
        """Choice i of the request samples with seed `sampling.seed + i`; each scores its prompt, with
        `prompt_logprobs` top alternatives per token, unless that is None; each output matches `grammar`
        when one is given; `keep`: special ids its text shows, for the reply parsers (reply.Markers)."""
        loop = asyncio.get_running_loop()
        stop_ids = () if ignore_eos else self.tokenizer.stop_ids
        try:
            for p, prompt_ids in enumerate(prompts):
                for j in range(n):
                    index = p * n + j
                    seeded = replace(sampling, seed=(sampling.seed + index) % 2**32)
                    request = Request(
                        list(prompt_ids), max_tokens[p], seeded, stop_ids, logprobs, prompt_logprobs, grammar
                    )
                    stream = self.runner.submit(request, loop)
                    completion = Completion(stream, self.tokenizer, self.runner.cancel, stop, keep)
                    self.choices.append(Choice(index, completion))
        except (Overloaded, ValueError) as e:  # a full queue, or the runner's own validation
            self.cancel()
            raise domain_error(e) from e
        self.prompt_tokens = sum(len(p) for p in prompts)  # counted once per prompt, whatever n is
        self.n = n
        self.metrics.prompt_tokens.inc(self.prompt_tokens * n)
        if grammar is not None:
            self.metrics.constrained_requests.inc(len(self.choices))

    def cancel(self) -> None:
        for c in self.choices:
            c.completion.cancel()

    async def updates(self) -> AsyncIterator[Update]:
        """Updates of all choices, interleaved as they come; ends when every choice finished."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice):
            async for event in choice.completion.stream:
                merged.put_nowait((choice, event))
                if merged.qsize() > self.max_backlog and not self.fell_behind:
                    self.fell_behind = True
                    self.cancel()

        tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        try:
            remaining = len(self.choices)
            while remaining:
                choice, event = await merged.get()
                if self.fell_behind:
                    raise APIError(429, f"the client fell more than {self.max_backlog} updates behind its stream")
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
        try:
            delta = choice.completion.feed(event)
        except GenerationFailed as e:  # internal details are logged, not sent; the server's state is
            log.error("generation %s failed: %s", self.id, e)
            detail = str(e) if e.public else "the details are in the server log"
            raise APIError(500, f"the generation failed (id {self.id}): {detail}", "server_error") from e
        if delta is None:
            return None
        if delta.token is not None:
            self._observe_token(choice)
        if delta.finish_reason is not None:
            self._finish(choice, OPENAI_FINISH.get(delta.finish_reason, "stop"))
        elif not delta.text and not delta.logprobs and delta.prompt is None:
            return None  # EOS: no text, and no logprob a client sees
        return Update(choice, delta.text, delta.logprobs, choice.finish_reason, delta.prompt)

    def _observe_token(self, choice: Choice) -> None:
        now = time.monotonic()
        stream = choice.completion.stream
        if choice.completion.tokens == 1:
            self.metrics.ttft.observe(now - self.started)
            if stream.cached_tokens is not None:  # the prefix cache looked the prompt up
                self.metrics.prefix_lookup_tokens.inc(len(stream.request.prompt_ids))
                self.metrics.prefix_hit_tokens.inc(stream.cached_tokens)
            if stream.admitted_at is not None:
                self.metrics.queue_time.observe(max(0.0, stream.admitted_at - stream.request.submitted_at))
        elif choice.last_token_at is not None:
            self.metrics.itl.observe(now - choice.last_token_at)
        choice.last_token_at = now
        self.metrics.generation_tokens.inc()

    def _finish(self, choice: Choice, reason: str) -> None:
        choice.finish_reason = reason
        self.metrics.requests.labels(finish_reason=reason).inc()
        self.metrics.e2e.observe(time.monotonic() - self.started)

    def usage(self) -> dict:
        """OpenAI's usage; with the prefix cache on, prompt_tokens_details.cached_tokens: per prompt, the
        fewest of its tokens any of its choices reused (prompt_tokens counts each prompt once too)."""
        out = usage(self.prompt_tokens, sum(c.completion.tokens for c in self.choices))
        cached = [c.completion.stream.cached_tokens for c in self.choices]
        if cached and None not in cached:
            per_prompt = [min(cached[i : i + self.n]) for i in range(0, len(cached), self.n)]
            out["prompt_tokens_details"] = {"cached_tokens": sum(per_prompt)}
        return out
