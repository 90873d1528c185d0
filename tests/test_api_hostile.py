"""Hostile and careless clients (issue 15) against the HTTP layer: every client mistake is a 4xx with
OpenAI's body, a 500 tells nothing internal and keeps the connection, bodies are bounded as received,
CPU work leaves the event loop free, slow clients are cut off, and the queue limit is honest."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import anthropic
import httpx
import pytest
from helpers import init_params, tiny_config
from http_helpers import FakeRunner, LiveServer, validate
from sdk_types import strict, strict_message_event, strict_response_event, typed_events

from hkserve.api.app import create_app
from hkserve.api.limits import ServerLimits
from hkserve.api.protocol import APIError
from hkserve.api.response_store import ResponseStore
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Event, Overloaded, Request, RequestStream
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.sampling import InvalidSampling, SamplingParams

SCRIPT_TEXT = "Hello world! The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[2]


@pytest.fixture
def serve(tokenizer):
    servers = []

    def start(runner=None, limits=ServerLimits(), max_len=256, tok=None):
        runner = runner or FakeRunner(tokenizer.encode(SCRIPT_TEXT) + [tokenizer.eos_id])
        server = LiveServer(create_app(runner, tok or tokenizer, "m", max_len, limits=limits), limits)
        servers.append(server)
        return server, runner

    yield start
    for s in servers:
        s.stop()


def error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    validate(response.json(), "ErrorResponse")
    return response.json()["error"]


def post_raw(server, path: str, body: str) -> httpx.Response:
    return httpx.post(server.url + path, content=body.encode("utf-8", "surrogatepass"), timeout=30)


def until(condition, timeout: float = 120.0) -> bool:
    """Poll `condition` until it holds or `timeout` passes; returns whether it held. Only for uvicorn's
    own state (connections, tasks), which has no event to wait on; the timeout only bounds a hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


CHAT = '{"messages":[{"role":"user","content":%s}],"max_tokens":1}'
CLIENT_MISTAKES = [  # (path, raw JSON body, the param named or None): each one a 400
    ("/v1/completions", '{"prompt":"Hi","max_tokens":2,"top_k":2147483648}', "top_k"),  # item 1's repro
    ("/v1/completions", '{"prompt":"Hi","max_tokens":1,"logit_bias":{"49152":1}}', "logit_bias"),
    ("/v1/completions", '{"prompt":"Hi","max_tokens":1,"logit_bias":{"-1":1}}', "logit_bias"),
    ("/v1/completions", '{"prompt":"Hi","max_tokens":1,"logit_bias":{"%s":1}}' % ("7" * 400), "logit_bias"),
    ("/v1/completions", '{"prompt":"Hi","max_tokens":1,"logit_bias":{"\u00b2":1}}', "logit_bias"),
    ("/v1/completions", '{"prompt":"\\udc00","max_tokens":1}', None),
    ("/v1/chat/completions", CHAT % '"a\\udc00b"', None),
    ("/v1/chat/completions", CHAT % '[{"type":"text","text":"\\ud800"}]', None),
    ("/tokenize", '{"prompt":"\\udc00"}', None),
    ("/tokenize", '{"messages":[{"role":"user","content":"\\udfff"}]}', None),
    ("/v1/completions", '{"prompt":"Hi","extra":' + "[" * 1000 + "]" * 1000 + "}", None),
    ("/v1/completions", '{"prompt":"Hi","extra":' + "[" * 40 + "]" * 40 + "}", None),
    ("/v1/completions", '{"prompt":"Hi","max_tokens":' + "1" * 5000 + "}", None),
    ("/v1/completions", '{"prompt":[1,%s]}' % ("9" * 400), "prompt"),
    ("/v1/completions", '{"prompt":[true,false],"max_tokens":1}', "prompt"),
    ("/v1/completions", '{"prompt":"Hi","max_tokens":1,"repetition_penalty":Infinity}', None),
    ("/v1/completions", '{"prompt":"Hi","max_tokens":1,"temperature":NaN}', None),
    ("/detokenize", '{"tokens":[true]}', "tokens"),
]


@pytest.mark.parametrize("path,body,param", CLIENT_MISTAKES)
def test_client_mistakes_are_400s_with_openai_bodies(serve, path, body, param):
    server, runner = serve()
    err = error(post_raw(server, path, body), 400)
    if param:
        assert err["param"] == param, err
    assert not runner.submitted
    assert httpx.get(server.url + "/health").status_code == 200


def test_true_and_false_are_not_token_ids_and_infinity_is_no_penalty(serve):
    """Item 12: bool is an int subclass, and Python's JSON reads Infinity: both are refused."""
    server, _ = serve()
    assert "prompt" in error(post_raw(server, "/v1/completions", '{"prompt":[true,false]}'), 400)["message"]
    assert "Infinity" in error(post_raw(server, "/v1/completions", '{"prompt":"x","top_p":-Infinity}'), 400)["message"]
    with pytest.raises(InvalidSampling, match="repetition_penalty"):
        SamplingParams(repetition_penalty=float("inf"))
    assert post_raw(server, "/v1/completions", '{"prompt":[1,0],"max_tokens":1}').status_code == 200


class BrokenRunner(FakeRunner):
    """Submitting raises an unexpected error carrying internal details; a prompt of [13] instead ends
    with the runner's error event (a failed generation)."""

    def submit(self, request, loop=None):
        if request.prompt_ids == [13]:
            stream = RequestStream(request, loop)
            stream.push(Event(request.id, None, "error", "device detail: XLA said no"))
            return stream
        raise RuntimeError("secret internal detail")


def test_a_500_names_a_request_id_tells_nothing_internal_and_keeps_the_connection(serve, tokenizer):
    server, _ = serve(BrokenRunner(tokenizer.encode(SCRIPT_TEXT)))
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    for prompt, detail in (("hi", "secret internal detail"), ([13], "XLA said no")):
        conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 1}))
        response = conn.getresponse()
        body = json.loads(response.read())
        assert response.status == 500
        validate(body, "ErrorResponse")
        assert detail not in body["error"]["message"] and "RuntimeError" not in body["error"]["message"]
        assert "id" in body["error"]["message"] and body["error"]["type"] == "server_error"
        assert response.getheader("connection") != "close"
        sock = conn.sock
        conn.request("GET", "/health")  # the same connection still serves
        assert conn.getresponse().read() == b'{"status":"ok"}' and conn.sock is sock
    conn.close()


def test_body_limit_counts_the_bytes_received_chunked_or_not_on_every_route(serve):
    server, _ = serve(limits=ServerLimits(max_body_bytes=1024))

    def chunked(size: int):
        body = json.dumps({"prompt": "x" * size, "max_tokens": 1}).encode()
        for i in range(0, len(body), 100):
            yield body[i : i + 100]

    for method, path in (("POST", "/v1/completions"), ("POST", "/tokenize"), ("GET", "/health"), ("GET", "/nope")):
        r = httpx.request(method, server.url + path, content=chunked(4000), timeout=30)
        assert "transfer-encoding" not in r.request.headers or r.request.headers["transfer-encoding"] == "chunked"
        assert error(r, 413)["message"] == "request body larger than 1024 bytes"
        assert r.headers["connection"] == "close"
    assert error(httpx.post(server.url + "/v1/completions", content=b"x" * 2000), 413)
    assert httpx.post(server.url + "/v1/completions", content=chunked(500), timeout=30).status_code == 200


class GatedTokenizer:
    """The real tokenizer, whose encode waits for `gate`: a request holds a CPU thread while it waits."""

    def __init__(self, inner):
        self.inner, self.gate, self.entered, self.calls = inner, threading.Event(), threading.Semaphore(0), 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text, add_bos=None):
        self.calls += 1
        self.entered.release()
        assert self.gate.wait(60)
        return self.inner.encode(text, add_bos)


def test_tokenizing_large_chats_leaves_the_event_loop_free_and_hopeless_prompts_are_not_tokenized(serve, tokenizer):
    gated = GatedTokenizer(tokenizer)
    server, _ = serve(tok=gated, max_len=1_000_000)
    content = "The quick brown fox. " * 20_000  # 420 kB
    results = []

    def chat():
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
        results.append(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).status_code)

    threads = [threading.Thread(target=chat) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in threads:  # all three are being tokenized at once, each held at the gate
        assert gated.entered.acquire(timeout=60)
    for _ in range(5):  # answered while all three are still held: a blocked event loop would never answer
        assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    assert not gated.gate.is_set()
    gated.gate.set()
    for t in threads:
        t.join(120)
    assert results == [200, 200, 200]

    small, _ = serve(tok=gated, max_len=256)
    calls = gated.calls
    r = httpx.post(small.url + "/v1/completions", json={"prompt": "a" * 2_000_000, "max_tokens": 1}, timeout=30)
    assert error(r, 400)["code"] == "context_length_exceeded"
    chat = {"messages": [{"role": "user", "content": "a" * 2_000_000}], "max_tokens": 1}
    assert error(httpx.post(small.url + "/v1/chat/completions", json=chat, timeout=30), 400)["param"] == "messages"
    assert gated.calls == calls  # refused before tokenizing


def raw_connection(server, request: bytes = b"", rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(request)
    sock.settimeout(30)
    return sock


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_slow_heads_and_bodies_are_cut_off_and_connections_are_capped(serve):
    limits = ServerLimits(header_timeout_s=0.5, body_timeout_s=0.5, max_connections=3)
    server, _ = serve(limits=limits)
    slowloris = raw_connection(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert read_all(slowloris) == b""  # closed without an answer
    half_body = raw_connection(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    head, _, body = read_all(half_body).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    validate(json.loads(body), "ErrorResponse")

    idle = [raw_connection(server) for _ in range(3)]
    assert until(lambda: len(server.server.server_state.connections) == 3)
    assert httpx.get(server.url + "/health").status_code == 503  # over the cap
    for sock in idle:
        sock.close()
    assert until(lambda: httpx.get(server.url + "/health").status_code == 200)


def never_reading_stream(server) -> socket.socket:
    """A streaming request for 500,000 tokens from a client with a tiny receive buffer that never reads."""
    body = json.dumps({"prompt": "x", "max_tokens": 500_000, "stream": True}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return raw_connection(server, head + b"Content-Length: %d\r\n\r\n" % len(body) + body, rcvbuf=4096)


@pytest.mark.parametrize("limit", ["backlog", "send timeout"])
def test_a_client_that_never_reads_its_stream_is_cancelled(serve, tokenizer, limit):
    """Either limit alone cancels the request (its slot frees); the other is set out of reach."""
    runner = FakeRunner(tokenizer.encode(SCRIPT_TEXT))  # no EOS: it produces until max_tokens
    if limit == "backlog":
        limits = ServerLimits(max_stream_backlog=64, send_timeout_s=600)
    else:
        limits = ServerLimits(max_stream_backlog=10**9, send_timeout_s=1.0)
    server, _ = serve(runner, limits, max_len=1_000_000)
    sock = never_reading_stream(server)
    assert runner.wait_until(lambda: runner.submitted and runner.submitted[0].id in runner.cancelled)
    assert runner.wait_until(lambda: not runner.running)  # the slot is free
    if limit == "send timeout":
        assert until(lambda: not server.server.server_state.tasks)  # the blocked response gave up
        data = read_all(sock)  # what was already sent, then the end of the connection
        assert data.startswith(b"HTTP/1.1 200") and data.count(b"data: ") < 100_000
    sock.close()


def test_a_request_needing_more_choices_than_the_queue_is_400_and_a_refused_one_releases_its_choices(serve):
    config = tiny_config(vocab_size=96)
    model = build_model(config)
    engine = Engine(model, init_params(config, 0), EngineOptions(slots=1, max_len=64, prefill_buckets=(8,)))
    runner = InferenceRunner(engine, max_queue=4)  # never started: whatever is queued stays queued
    runner.ready.set()
    server, _ = serve(runner)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [[5], [6], [7]], "n": 2, "max_tokens": 1})
    err = error(r, 400)
    assert "6 choices" in err["message"] and "at most 4" in err["message"] and err["param"] == "n"
    held = [runner.submit(Request([5], 1)) for _ in range(2)]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5], "n": 3, "max_tokens": 1})
    assert error(r, 429) and r.headers["retry-after"] == "1"
    held += [runner.submit(Request([5], 1)) for _ in range(2)]  # the two choices it had queued are gone
    with pytest.raises(Overloaded):  # and the queue of 4 is full again with the held requests
        runner.submit(Request([5], 1))


# -- the Responses and Anthropic Messages routes (hkserve/api/routes/{responses,messages}.py) -----------
MESSAGES_BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def anthropic_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    strict(anthropic.types.ErrorResponse, response.json())
    return response.json()["error"]


def test_x_api_key_beside_bearer_and_anthropic_errors_before_any_route(serve, tokenizer):
    runner = FakeRunner(tokenizer.encode(SCRIPT_TEXT) + [tokenizer.eos_id])
    limits = ServerLimits(max_body_bytes=1000)
    server = LiveServer(create_app(runner, tokenizer, "m", 256, api_key="k3y", limits=limits), limits)
    try:
        url = server.url + "/v1/messages"
        assert anthropic_error(httpx.post(url, json=MESSAGES_BODY), 401)["type"] == "authentication_error"
        assert anthropic_error(httpx.post(url, json=MESSAGES_BODY, headers={"x-api-key": "nope"}), 401)
        assert httpx.post(url, json=MESSAGES_BODY, headers={"x-api-key": "k3y"}).status_code == 200
        assert httpx.post(url, json=MESSAGES_BODY, headers={"authorization": "Bearer k3y"}).status_code == 200
        body = {"input": "Hi", "max_output_tokens": 4}
        assert httpx.post(server.url + "/v1/responses", json=body, headers={"x-api-key": "k3y"}).status_code == 200
        error(httpx.post(server.url + "/v1/responses", json=body), 401)  # OpenAI's body off the Messages route
        big = anthropic_error(httpx.post(url, content=b"x" * 2000, headers={"x-api-key": "k3y"}), 413)
        assert "1000 bytes" in big["message"]
        client = anthropic.Anthropic(base_url=server.url, api_key="k3y", max_retries=0)
        assert client.messages.create(model="m", **MESSAGES_BODY).content[0].text == "Hello world! The"
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=server.url, api_key="bad", max_retries=0).messages.create(
                model="m", **MESSAGES_BODY
            )
    finally:
        server.stop()


class FailingRunner(FakeRunner):
    """Every generation ends with the runner's error event (a failed generation), with internal details."""

    def submit(self, request, loop=None):
        stream = RequestStream(request, loop)
        stream.push(Event(request.id, None, "error", "device detail: XLA said no"))
        return stream


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_a_failed_generation_is_a_500_or_a_typed_error_event_telling_nothing_internal(serve, tokenizer, path):
    server, _ = serve(FailingRunner(tokenizer.encode(SCRIPT_TEXT)))
    body = {"input": "x"} if path == "/v1/responses" else {**MESSAGES_BODY}
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = typed_events(r)
    assert events[-1]["type"] == "error" and "XLA" not in json.dumps(events[-1]), events
    check_event = strict_response_event if path == "/v1/responses" else strict_message_event
    for event in events:
        check_event(event)
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 500 and "secret" not in r.text
    if path == "/v1/messages":
        assert anthropic_error(r, 500)["type"] == "api_error"
    else:
        error(r, 500)


def test_response_store_keeps_the_most_recent_within_its_count_and_bytes():
    store = ResponseStore(max_responses=2, max_bytes=250)  # each `one` is 73 bytes of JSON, `big` 153
    one = [{"role": "user", "content": "a" * 40}]
    store.put("r1", one)
    store.put("r2", one)
    assert store.get("r1") == one  # r1 is now the most recent
    store.put("r3", one)  # the count limit drops the least recently used: r2
    assert len(store) == 2 and store.get("r3") == one and store.get("r1") == one
    with pytest.raises(APIError) as e:
        store.get("r2")
    assert e.value.status == 400 and e.value.param == "previous_response_id"
    big = [{"role": "user", "content": "b" * 120}]  # with r1 and r3 over 250 bytes: r3 (LRU) goes
    store.put("r4", big)
    assert store.bytes <= 250 and store.get("r4") == big and store.get("r1") == one
    with pytest.raises(APIError):
        store.get("r3")
    store.put("huge", [{"role": "user", "content": "c" * 300}])  # larger than the whole store: not kept
    with pytest.raises(APIError):
        store.get("huge")
    assert store.get("r4") == big


def test_responses_store_false_is_not_kept_and_metadata_comes_back(serve):
    server, runner = serve()
    url = server.url + "/v1/responses"
    kept = httpx.post(url, json={"input": "Hi", "max_output_tokens": 2, "metadata": {"k": "v"}}).json()
    assert kept["metadata"] == {"k": "v"}
    unkept = httpx.post(url, json={"input": "Hi", "max_output_tokens": 2, "store": False}).json()
    follow = httpx.post(url, json={"input": "and?", "max_output_tokens": 2, "previous_response_id": kept["id"]})
    assert follow.status_code == 200 and follow.json()["previous_response_id"] == kept["id"]
    # the follow-up's prompt holds the stored turn: "Hi", the reply, then "and?"
    assert len(runner.submitted[-1].prompt_ids) > len(runner.submitted[0].prompt_ids)
    r = httpx.post(url, json={"input": "and?", "previous_response_id": unkept["id"]})
    assert error(r, 400)["param"] == "previous_response_id"
