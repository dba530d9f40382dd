"""JSON request bodies read at the edge: bytes that are not UTF-8 or nest too deeply are a 400,
a client gone before its body arrived a 499.

msgspec raises ``UnicodeDecodeError`` and ``RecursionError`` for these, outside its own
``DecodeError``; both are the client's doing, so they leave as ``invalid_json`` rather than a 500.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

import msgspec
from litestar import Request
from litestar.connection.base import empty_receive, empty_send
from litestar.exceptions import InternalServerException
from litestar.types import Receive, ReceiveMessage, Scope, Send

from web.ops.errors import ApiError, bad_request

T = TypeVar("T")


def invalid_json(reason: str = "We could not parse the JSON body of your request.") -> ApiError:
    return ApiError(400, reason, code="invalid_json")


def unreadable_json(exc: UnicodeDecodeError | RecursionError) -> ApiError:
    """The 400 for a body msgspec cannot even read."""
    if isinstance(exc, UnicodeDecodeError):
        return invalid_json("The JSON body of your request is not valid UTF-8.")
    return invalid_json("The JSON body of your request is nested too deeply.")


def decode_json(
    body: bytes, type_: type[T], param_of: Callable[[str], str | None] | None = None
) -> T:
    """Decode ``body`` into ``type_``; any malformed body or wrong type raises a 400 ApiError.

    ``param_of`` maps a validation message to the offending parameter's path (or None).
    """
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        param = param_of(str(exc)) if param_of is not None else None
        raise bad_request(f"Invalid request: {exc}", param=param) from exc
    except msgspec.DecodeError as exc:
        raise invalid_json() from exc
    except (UnicodeDecodeError, RecursionError) as exc:
        raise unreadable_json(exc) from exc


def client_closed() -> ApiError:
    """The 499 (nginx's "client closed request") of a client gone before its answer: logged at
    info level, never sent (nobody is left to read it)."""
    return ApiError(499, "The client closed the request.", code="client_closed_request")


class JsonRequest(Request[Any, Any, Any]):
    """The gateway's request class: Litestar's own JSON body parsing (``data: JSONBody[...]``)
    refuses unreadable bodies with a 400 instead of letting msgspec's errors become a 500, and a
    client that leaves while its body is still arriving is a 499, not Litestar's 500."""

    def __init__(self, scope: Scope, receive: Receive = empty_receive, send: Send = empty_send):
        self.client_gone = False  # an http.disconnect came while the body was being read

        async def watched() -> ReceiveMessage:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.client_gone = True
            return message

        super().__init__(scope, watched, send)

    async def stream(self) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in super().stream():
                yield chunk
        except InternalServerException:
            if self.client_gone:
                raise client_closed() from None
            raise

    async def json(self) -> Any:
        try:
            return await super().json()
        except (UnicodeDecodeError, RecursionError) as exc:
            raise unreadable_json(exc) from exc
