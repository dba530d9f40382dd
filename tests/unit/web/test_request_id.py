"""Which client request ids are kept, and the id a request gets once and keeps."""

from __future__ import annotations

from typing import Any

import pytest

from web.ops.request_id import RequestId, client_request_id, request_id_of


@pytest.mark.parametrize(
    "value", ["a", "req_123", "0b1c3f2e-9d4a-4f7e-8a61-7d2f1c9e0a55", "span:1/2+3=4.5", "x" * 128]
)
def test_sane_ids_are_kept(value: str) -> None:
    assert client_request_id(value) == value


@pytest.mark.parametrize(
    "value", [None, "", "x" * 129, "two words", "tab\tin", "new\nline", 'quote"', "é", "a;b"]
)
def test_anything_else_is_not_taken(value: str | None) -> None:
    assert client_request_id(value) is None


def test_the_id_is_decided_once_per_request() -> None:
    scope: Any = {"type": "http", "headers": [(b"X-Request-Id", b"mine-1")], "state": {}}
    first = request_id_of(scope)
    assert first == RequestId("mine-1", from_client=True)
    first.name("chatcmpl-abc")  # the client's id stands
    assert request_id_of(scope).value == "mine-1"
    fresh: Any = {"type": "http", "headers": [(b"x-request-id", b"not ok")], "state": {}}
    generated = request_id_of(fresh)
    assert not generated.from_client and generated.value.startswith("req-")
    generated.name("cmpl-xyz")
    assert request_id_of(fresh).value == "cmpl-xyz"
