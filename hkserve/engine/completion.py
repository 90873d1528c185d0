"""One request's runner events as a client sees them: text, finish reason, usage and logprobs.

The single place below HTTP and the CLI that knows what a client is owed: EOS ends a completion but
shows no text, a stop string ends it early (held back across token boundaries, never leaked, and the
runner told to stop), text is released only as whole UTF-8 characters.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import NamedTuple

from hkserve.checkpoint.tokenizer import Tokenizer
from hkserve.engine.outputs import ScoredToken, Token
from hkserve.engine.requests import Event, RequestStream
from hkserve.engine.textstream import TextStream


class GenerationFailed(RuntimeError):
    """The runner ended the request with an error (a device failure, a lost host). `public`: the
    message describes the server's state (a lost host) rather than an internal failure."""

    def __init__(self, message: str, public: bool = False):
        super().__init__(message)
        self.public = public


class Delta(NamedTuple):
    """What one runner event added to a completion."""

    text: str  # newly released text (may be empty)
    token: Token | None  # the token that arrived (counted in usage); None for the runner's final event
    logprobs: list[Token]  # tokens whose logprobs the client sees: the token, unless it was EOS
    finish_reason: str | None  # stop | length | cancelled, once the completion has ended
    prompt: list[ScoredToken] | None = None  # the scored prompt (tokens 1..), when it was asked for


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Completion:
    """Turns a RequestStream into Deltas: `feed` one event, or iterate (blocking or `async for`).

    `cancel` is the runner's: a stop string ends the completion before the runner knows, so it is
    told to free the slot; events after the end are the runner catching up and are dropped."""

    def __init__(
        self,
        stream: RequestStream,
        tokenizer: Tokenizer,
        cancel: Callable[[str], None],
        stop: Sequence[str] | None = None,
        keep: frozenset[int] = frozenset(),
    ):
        """`keep`: special ids whose text is released, for a reply parser to read (detokenize.py)."""
        self.stream = stream
        self.request = stream.request
        self._cancel = cancel
        self._text = TextStream(tokenizer, list(stop or ()), keep)
        self.tokens = 0  # tokens delivered before the end, EOS included
        self.finish_reason: str | None = None

    @property
    def text(self) -> str:
        """All the text released so far."""
        return self._text.text

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the completion, if one did (Anthropic's `stop_sequence`)."""
        return self._text.stopped_by

    def usage(self) -> dict[str, int]:
        return usage(len(self.request.prompt_ids), self.tokens)

    def cancel(self) -> None:
        """End the request early (its client went away); a no-op once it has ended."""
        if self.finish_reason is None:
            self._cancel(self.request.id)

    def feed(self, event: Event) -> Delta | None:
        """Apply one event; None when it changes nothing the client sees. Raises GenerationFailed."""
        if event.error:
            raise GenerationFailed(event.error, public=event.error_public)
        if self.finish_reason is not None:
            return None
        if event.prompt is not None:
            return Delta("", None, [], None, event.prompt)
        if event.token is None:
            self.finish_reason = event.finish_reason
            return Delta(self._text.finish(), None, [], self.finish_reason)
        token = event.token
        self.tokens += 1
        if token.id in self.request.stop_ids:
            return Delta("", token, [], None)  # EOS: no text; the runner's final event follows
        piece = self._text.add(token.id)
        if piece.stopped:
            self.finish_reason = "stop"
            self._cancel(self.request.id)
        return Delta(piece.text, token, [token], self.finish_reason)

    def __iter__(self) -> Iterator[Delta]:
        for event in self.stream:
            delta = self.feed(event)
            if delta is not None:
                yield delta

    async def __aiter__(self) -> AsyncIterator[Delta]:
        async for event in self.stream:
            delta = self.feed(event)
            if delta is not None:
                yield delta
