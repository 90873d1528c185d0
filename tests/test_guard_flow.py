"""The guard's request flow, driven directly with ASGI messages: the request-wide check, a client that
leaves or stalls while sending its body, the body replayed to the route, an exception as a 500 that
names a request id, and a client that stops reading (issue 38's mutation testing of api/guard.py)."""

from __future__ import annotations

import json
import logging
import re

import pytest
from asgi_helpers import Recorder, body_messages, drive, error, response

from hkserve.api.limits import ServerLimits
from hkserve.api.protocol import APIError

LIMITS = ServerLimits(max_body_bytes=100, body_timeout_s=0.01, send_timeout_s=0.01)


def test_other_scopes_pass_through_untouched():
    app = Recorder(reads=1)
    messages = [{"type": "lifespan.startup"}]
    drive(app, messages, LIMITS, scope_type="lifespan", check=lambda scope: 1 / 0)
    assert app.received == [{"type": "lifespan.startup"}] and app.scopes[0]["type"] == "lifespan"


def test_a_refused_check_answers_with_its_error_and_never_calls_the_route():
    def check(scope):
        assert scope["path"] == "/v1/completions"
        raise APIError(401, "bad key", "authentication_error", headers={"WWW-Authenticate": "Bearer"})

    app = Recorder()
    sent = drive(app, body_messages([b"{}"]), LIMITS, check=check)
    status, headers, _ = response(sent)
    assert status == 401 and headers[b"www-authenticate"] == b"Bearer" and app.scopes == []
    assert error(sent) == {"message": "bad key", "type": "authentication_error", "param": None, "code": None}


def test_a_refusal_on_the_anthropic_messages_route_is_in_anthropics_error_body():
    """/v1/messages clients (the anthropic SDK) read Anthropic's error shape, the guard's refusals too."""
    app = Recorder()
    sent = drive(app, body_messages([b"x" * 60, b"x" * 41]), LIMITS, path="/v1/messages")
    status, _, body = response(sent)
    payload = json.loads(body)
    assert status == 413 and app.scopes == [] and payload["type"] == "error"
    assert payload["error"]["type"] == "invalid_request_error" and "100" in payload["error"]["message"]
    assert payload["request_id"].startswith("req_")


def test_a_client_that_leaves_while_sending_gets_nothing_and_the_route_never_runs():
    app = Recorder()
    assert drive(app, [*body_messages([b"ab", b"cd"])[:1], {"type": "http.disconnect"}], LIMITS) == []
    assert app.scopes == []


def test_a_body_that_stops_arriving_is_a_408_that_closes_the_connection():
    app = Recorder()
    sent = drive(app, body_messages([b"ab", b"cd"])[:1], LIMITS)  # more_body, then nothing
    status, headers, _ = response(sent)
    assert status == 408 and headers[b"connection"] == b"close" and app.scopes == []
    assert error(sent)["message"] == "the request body did not arrive within 0.01 s"


def test_the_route_reads_the_body_once_whole_then_only_what_the_client_sends_next():
    app = Recorder(reads=2)
    sent = drive(app, [*body_messages([b"a", b"b"]), {"type": "http.disconnect"}], LIMITS)
    assert app.received == [{"type": "http.request", "body": b"ab", "more_body": False}, {"type": "http.disconnect"}]
    assert app.scopes[0]["path"] == "/v1/completions"
    assert response(sent)[::2] == (200, b"ok")


def test_an_exception_before_the_response_is_a_500_naming_a_request_id_in_the_log(caplog):
    app = Recorder(fail=RuntimeError("secret detail"))
    with caplog.at_level(logging.ERROR, "hkserve.api"):
        sent = drive(app, body_messages([b"{}"]), LIMITS)
    status, headers, _ = response(sent)
    message = error(sent)["message"]
    assert status == 500 and error(sent)["type"] == "server_error" and "secret" not in message
    request_id = re.fullmatch(
        r"internal server error \(request id ([0-9a-f]{32})\); the details are in the server log", message
    )[1]
    assert [r.getMessage() for r in caplog.records] == [f"request {request_id} (POST /v1/completions) failed"]
    assert b"connection" not in headers  # the body was read whole: the connection stays usable


def test_an_exception_mid_response_propagates_after_the_sent_start():
    app = Recorder(fail=RuntimeError("cut"), fail_after_start=True)
    with pytest.raises(RuntimeError, match="cut"):
        drive(app, body_messages([b"{}"]), LIMITS)


def test_a_client_that_stops_reading_is_logged_and_dropped(caplog):
    with caplog.at_level(logging.WARNING, "hkserve.api"):
        assert drive(Recorder(), body_messages([b"{}"]), LIMITS, send_blocks=True) == []
    assert [r.getMessage() for r in caplog.records] == [
        "POST /v1/completions: the client stopped reading; closing the connection"
    ]
