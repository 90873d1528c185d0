"""The guard's body accounting, driven directly with ASGI messages: uvicorn merges the chunks of a real
connection before they reach the app, so only a direct drive proves that many small `http.request`
messages are counted together against `max_body_bytes` (issue 38)."""

from __future__ import annotations

from asgi_helpers import Recorder, body_messages, drive, error, response

from hkserve.api.limits import ServerLimits

LIMITS = ServerLimits(max_body_bytes=100)


def test_many_small_chunks_adding_past_the_limit_are_refused_with_413():
    app = Recorder()
    sent = drive(app, body_messages([b"x" * 7] * 15), LIMITS)  # 105 bytes in 7-byte messages
    status, headers, _ = response(sent)
    assert status == 413 and headers[b"connection"] == b"close" and app.received == []
    assert error(sent) == {
        "message": "request body larger than 100 bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


def test_small_chunks_adding_up_to_exactly_the_limit_reach_the_app_whole():
    chunks = [bytes([65 + i]) * 10 for i in range(10)]  # 100 bytes: at the limit, not past it
    app = Recorder()
    assert response(drive(app, body_messages(chunks), LIMITS))[::2] == (200, b"ok")
    assert app.received == [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]


def test_one_byte_past_the_limit_in_the_last_of_many_chunks_is_refused():
    app = Recorder()
    assert response(drive(app, body_messages([b"y" * 10] * 10 + [b"z"]), LIMITS))[0] == 413
    assert app.received == []


def test_messages_without_a_body_count_as_empty():
    app = Recorder()
    messages = [{"type": "http.request", "more_body": True}, *body_messages([b"ab", b"c"])]
    assert response(drive(app, messages, LIMITS))[0] == 200
    assert app.received[0]["body"] == b"abc"


def test_a_message_without_more_body_ends_the_body():
    app = Recorder()
    assert response(drive(app, [{"type": "http.request", "body": b"abc"}], LIMITS))[::2] == (200, b"ok")
    assert app.received[0]["body"] == b"abc"


def test_a_declared_length_is_refused_before_reading_only_past_the_limit():
    for declared, status in ((b"101", 413), (b"100", 200), (b"x101", 200)):  # not digits: the count decides
        app = Recorder()
        sent = drive(app, body_messages([b"x" * 100]), LIMITS, headers=[(b"content-length", declared)])
        assert response(sent)[0] == status, declared
        assert (app.received == []) == (status == 413)
        if status == 413:
            assert error(sent)["message"] == "request body larger than 100 bytes"
