"""OpenAI-compatible request models and the OpenAI error body.

Unknown fields are accepted and ignored (clients send extras), except those known to change what the
client gets back and not implemented here (UNSUPPORTED): those are refused rather than silently dropped.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator

from hkserve.engine.requests import Overloaded
from hkserve.engine.state import ContextLengthError
from hkserve.model.sampling import InvalidSampling, SamplingParams

MAX_N = 16
MAX_DEPTH = 32  # JSON nesting a request body may have (OpenAI's requests need a handful of levels)
TokenId = Annotated[int, Strict()]  # not a bool: true and false are not token ids
MAX_STOP = 16
OPENAI_SAMPLING = SamplingParams(temperature=1.0)  # OpenAI's default temperature; the engine's is greedy
COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for completions (chat has none: to the context)
# Fields of OpenAI's and vLLM's APIs that change the output and that this server does not implement: a
# request setting one (to anything but null, false, 0 or empty) is a 400 naming it, never silently served.
UNSUPPORTED = {
    "functions": "use tools",  # OpenAI's deprecated forms of tools
    "function_call": "use tool_choice",
    "audio": "this server writes text only",
    "use_beam_search": "beam search is not implemented",
    "min_tokens": "min_tokens is not implemented",
    "include_stop_str_in_output": "stop strings are never included",
    "guided_json": "use response_format or structured_outputs",  # vLLM's former names
    "guided_regex": "use structured_outputs.regex",
    "guided_choice": "use structured_outputs.choice",
    "guided_grammar": "use structured_outputs.grammar",
}


class APIError(Exception):
    """An error with an HTTP status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None  # checked by prepare.token_limits (engine.state.check_max_tokens)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    # Sampling: types only. Ranges and defaults are SamplingParams' (None = its default), see sampling().
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension (as in vLLM): generate max_tokens even past end-of-sequence
    # What the output must match: checked by hkserve/api/structured.py, compiled by engine/constrained.py
    response_format: Any = None
    structured_outputs: Any = None  # vLLM's: {json | regex | choice | grammar}

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @model_validator(mode="after")
    def _checks(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        for name, instead in UNSUPPORTED.items():
            if (self.model_extra or {}).get(name):
                raise ValueError(f"{name} is not supported by this server ({instead})")
        modalities = (self.model_extra or {}).get("modalities")
        if isinstance(modalities, list) and any(m != "text" for m in modalities):
            raise ValueError("modalities: this server writes text only")
        return self

    def sampling(self, seed: int) -> SamplingParams:
        """The request's sampling settings, its own seed or else `seed`. Raises InvalidSampling."""
        return replace(OPENAI_SAMPLING, seed=seed).with_overrides(self.model_dump())


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = None  # 0: no tokens, the prompt alone (echoed or scored)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's: top alternatives per prompt token
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)  # only best_of == n (no choice to pick from) is served

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v, info):
        n = info.data.get("n", 1)
        if v is not None and v != n:
            raise ValueError(f"only best_of == n ({n}) is supported (no choice is picked from more), got {v}")
        return v

    @model_validator(mode="after")
    def _completion_checks(self):
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    def prompt_scoring(self) -> int | None:
        """Top alternatives per prompt token when the prompt comes back scored (echo with logprobs,
        prompt_logprobs, or max_tokens 0, the prompt alone); None when it does not."""
        echoed = self.logprobs if self.echo else None
        if echoed is None and self.prompt_logprobs is None and self.max_tokens != 0:
            return None
        return max(echoed or 0, self.prompt_logprobs or 0)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's past calls
    tool_call_id: str | None = None  # a tool result's call

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: Any = None  # checked by hkserve/api/tools.py
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra template variables (enable_thinking)

    @model_validator(mode="after")
    def _chat_checks(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def template_messages(self) -> list[dict]:
        """Messages as the chat template sees them (developer is a system message), with any past tool
        calls and tool results (tools.render_messages turns them into what the template takes)."""
        out = []
        for m in self.messages:
            message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name is not None:  # templates that write a speaker's name read it
                message["name"] = m.name
            if m.tool_calls:
                message["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[TokenId]


def parse_body(raw: bytes, model_cls: type[BaseModel]) -> BaseModel:
    """A request body as `model_cls`, or the 400 that says why not: not JSON (NaN and Infinity are
    not JSON numbers; an integer of more than 4,300 digits is refused by Python), nested deeper than
    MAX_DEPTH, a string with a lone surrogate (not Unicode text: no tokenizer or response can take
    it), not an object, or not the request."""
    try:
        data = json.loads(raw, parse_constant=_not_a_number)
    except RecursionError:
        raise APIError(400, f"the request body is nested more than {MAX_DEPTH} levels deep") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON ({e.msg} at position {e.pos})") from None
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8") from None
    except ValueError:  # int() refused a literal of more than 4,300 digits
        raise APIError(400, "the request body holds a number too long to read") from None
    _check_values(data)
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def _not_a_number(literal: str):
    raise APIError(400, f"the request body is not valid JSON ({literal} is not a JSON number)")


def _check_values(data) -> None:
    """Refuse nesting deeper than MAX_DEPTH and strings (values or keys) that are not Unicode text."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node)
            continue
        if not isinstance(node, (list, dict)):
            continue
        if depth > MAX_DEPTH:
            raise APIError(400, f"the request body is nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, dict):
            for key in node:
                _check_text(key)
            node = node.values()
        stack.extend((child, depth + 1) for child in node if isinstance(child, (str, list, dict)))


def _check_text(text: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(
                400, f"the request body holds a lone surrogate ({text[e.start]!r}), which is not text"
            ) from None


def validation_error(exc) -> APIError:
    """pydantic's first complaint as a 400 in OpenAI's shape, naming the field."""
    errors = exc.errors()
    first = errors[0] if errors else {"msg": str(exc), "loc": ()}
    loc = [str(x) for x in first.get("loc", ()) if x not in ("body",)]
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    # param: the request's field (a union's member names and list indexes follow it in the message)
    return APIError(400, f"{'.'.join(loc) + ': ' if loc else ''}{message}", param=loc[0] if loc else None)


def domain_error(exc: Overloaded | ValueError) -> APIError:
    """An exception of the layers below as the OpenAI error a client gets: bad requests are 400 (a
    context overflow with OpenAI's code), a full queue is 429. (A failed generation is a 500 whose
    details stay in the server log: Generation makes it.)"""
    if isinstance(exc, Overloaded):
        return APIError(429, f"the server is overloaded: {exc}", "rate_limit_exceeded", headers={"Retry-After": "1"})
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), param="max_tokens", code="context_length_exceeded")
    if isinstance(exc, InvalidSampling):
        return APIError(400, str(exc), param=exc.param)
    return APIError(400, str(exc))
