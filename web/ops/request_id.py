"""Every response's ``x-request-id``: the client's own when it sent a sane one, else ours.

The id lives in the request's ASGI scope from the first time it is asked for; a generation
route names it after its completion (``chatcmpl-…``) when the client sent none, and a
``before_send`` hook writes it on the response, errors and unknown routes included.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from litestar.datastructures import MutableScopeHeaders
from litestar.types import Message, Scope

HEADER = "x-request-id"
SCOPE_KEY = "atrium_request_id"
# What a client's id may be: a token that is safe in a header, a log line and a query.
SANE = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")


@dataclass(slots=True)
class RequestId:
    """The request's id; ``from_client``: the client chose it (and it is kept)."""

    value: str
    from_client: bool

    def name(self, generated: str) -> None:
        """Take ``generated`` as the id, unless the client named the request itself."""
        if not self.from_client:
            self.value = generated


def client_request_id(value: str | None) -> str | None:
    """The client's ``x-request-id`` when it is a sane token (1-128 of ``A-Z a-z 0-9 . _ : /
    + = -``); anything else is not taken (a fresh id answers instead)."""
    if value is None or SANE.fullmatch(value) is None:
        return None
    return value


def request_id_of(scope: Scope) -> RequestId:
    """The request's id, decided on the first call: the client's, or a fresh ``req-…``."""
    state = scope.setdefault("state", {})
    found = state.get(SCOPE_KEY)
    if isinstance(found, RequestId):
        return found
    given = None
    for name, value in scope.get("headers", ()):
        if name.lower() == HEADER.encode():
            given = client_request_id(value.decode("latin-1"))
            break
    found = RequestId(given or f"req-{secrets.token_hex(12)}", given is not None)
    state[SCOPE_KEY] = found
    return found


async def send_request_id(message: Message, scope: Scope) -> None:
    """Litestar ``before_send`` hook: the id on every HTTP response."""
    if message["type"] == "http.response.start":
        headers = MutableScopeHeaders.from_message(message)
        headers[HEADER] = request_id_of(scope).value
