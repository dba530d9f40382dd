"""JSON request bodies read at the edge: bytes that are not UTF-8 or nest too deeply are a 400.

msgspec raises ``UnicodeDecodeError`` and ``RecursionError`` for these, outside its own
``DecodeError``; both are the client's doing, so they leave as ``invalid_json`` rather than a 500.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from litestar import Request

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


class JsonRequest(Request[Any, Any, Any]):
    """The gateway's request class: Litestar's own JSON body parsing (``data: JSONBody[...]``)
    refuses unreadable bodies with a 400 instead of letting msgspec's errors become a 500."""

    async def json(self) -> Any:
        try:
            return await super().json()
        except (UnicodeDecodeError, RecursionError) as exc:
            raise unreadable_json(exc) from exc
