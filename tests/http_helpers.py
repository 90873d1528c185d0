"""Test helpers for the HTTP layer: a live uvicorn server in a thread, a fake runner, schema checks."""

from __future__ import annotations

import contextlib
import copy
import json
import socket
import threading
import time

import jsonschema
import uvicorn
from helpers import require_fixtures

from hkserve.api.app import create_app
from hkserve.api.limits import ServerLimits, uvicorn_config
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.outputs import Token
from hkserve.engine.requests import Event, Overloaded, RequestStream
from hkserve.engine.runner import InferenceRunner, RunnerStats
from hkserve.model.build import build_model


class LiveServer:
    """uvicorn on 127.0.0.1 at a free port, in a background thread."""

    def __init__(self, app, limits: ServerLimits = ServerLimits()):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn_config(app, limits, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:  # bounded by the test's timeout, not by a guess at startup time
            assert self.thread.is_alive(), "uvicorn ended before it started"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@contextlib.contextmanager
def smollm2_server(smollm2, name: str, slots: int, max_queue: int, max_len: int = 512):
    """(server, runner): SmolLM2 on the engine behind a live server, no warm-up (tests compile as they go)."""
    _, info, tokenizer, params = smollm2
    options = EngineOptions(slots=slots, max_len=max_len, prefill_buckets=(16, 64), n_top=5)
    engine = Engine(build_model(info.config), params, options)
    runner = InferenceRunner(engine, max_queue=max_queue).start(warmup=False)
    server = LiveServer(create_app(runner, tokenizer, name, engine.max_len))
    try:
        yield server, runner
    finally:
        server.stop()
        runner.stop()


class FakeRunner:
    """Runner stand-in whose "model" replays a fixed script of token ids, one every `delay` seconds.

    It honours max_tokens, stop ids (the script ends with EOS), cancel and a bounded queue, and
    records what happened, so HTTP behaviour can be checked without a model. With held=True no token
    comes until the test sets `go`; `wait_until` waits for a change of its state, without polling.
    A ServingRunner (hkserve/engine/protocols.py; tests/test_protocols.py) with no model of its own:
    grammar masks as wide as the tokenizer's vocabulary, none filled, no speculation."""

    vocab_size = None

    def __init__(
        self, script: list[int], delay: float = 0.0, max_queue: int = 100, ready: bool = True, held: bool = False
    ):
        self.script, self.delay, self.max_queue = script, delay, max_queue
        self.ready = threading.Event()
        if ready:
            self.ready.set()
        self.go = threading.Event()
        if not held:
            self.go.set()
        self.cancelled: set[str] = set()
        self.running: dict[str, RequestStream] = {}
        self.submitted: list = []
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified on each submit, cancel and finish

    def wait_until(self, condition, timeout: float = 120.0) -> bool:
        """Whether `condition` (read under the lock) came to hold; the timeout only bounds a hang."""
        with self.changed:
            return self.changed.wait_for(condition, timeout)

    def submit(self, request, loop=None) -> RequestStream:
        with self.lock:
            if len(self.running) >= self.max_queue:
                raise Overloaded("fake queue full")
            stream = RequestStream(request, loop)
            self.running[request.id] = stream
            self.submitted.append(request)
            self.changed.notify_all()
        threading.Thread(target=self._produce, args=(stream,), daemon=True).start()
        return stream

    def _produce(self, stream: RequestStream):
        request = stream.request
        stream.admitted_at = time.monotonic()
        reason = "length"
        for i in range(request.max_tokens):
            self.go.wait()
            time.sleep(self.delay)
            if request.id in self.cancelled:
                reason = "cancelled"
                break
            token_id = self.script[i % len(self.script)]
            top = [(token_id, -0.25), (7, -1.5), (8, -2.5)][: request.logprobs]
            stream.push(Event(request.id, Token(token_id, -0.25, top)))
            if token_id in request.stop_ids:
                reason = "stop"
                break
        stream.done = True
        stream.push(Event(request.id, None, reason))
        with self.changed:
            self.running.pop(request.id, None)
            self.changed.notify_all()

    def cancel(self, request_id: str) -> None:
        with self.changed:
            self.cancelled.add(request_id)
            self.changed.notify_all()

    def stats(self) -> RunnerStats:
        return RunnerStats(4, len(self.running), 0)

    def spec_counts(self) -> None:
        return None

    def observe_masks(self, observe) -> None:
        """No grammar masks are filled here: `observe` is never called."""


def _nullable_to_anyof(node):
    """OpenAPI 3.0's `nullable: true` as JSON Schema: anyOf [schema, null]."""
    if isinstance(node, dict):
        node = {k: _nullable_to_anyof(v) for k, v in node.items()}
        if node.pop("nullable", False):
            return {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [_nullable_to_anyof(v) for v in node]
    return node


_SPEC = None


def validate(instance, schema_name: str, streamed: bool = False) -> None:
    """Validate against OpenAI's published schema `#/components/schemas/<schema_name>`.

    `streamed` completion chunks: the published CreateCompletionResponse (documented as shared by
    streamed and whole responses) has a non-null finish_reason, yet OpenAI's API and every
    compatible server send null until the last chunk; that one field alone is widened to null."""

    global _SPEC
    if _SPEC is None:
        _SPEC = _nullable_to_anyof(json.loads((require_fixtures() / "openai" / "openapi-subset.json").read_text()))
    components = copy.deepcopy(_SPEC["components"])
    if streamed and schema_name == "CreateCompletionResponse":
        reason = components["schemas"][schema_name]["properties"]["choices"]["items"]["properties"]["finish_reason"]
        reason["enum"] = reason["enum"] + [None]
        reason["type"] = ["string", "null"]
    schema = {"$ref": f"#/components/schemas/{schema_name}", "components": components}
    jsonschema.validate(instance, schema, cls=jsonschema.Draft202012Validator)


def sse_events(response) -> list:
    """Parse an SSE body (httpx streaming response) into JSON objects, with the final "[DONE]" kept."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
