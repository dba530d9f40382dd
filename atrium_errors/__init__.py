"""The one base of Atrium's errors; a leaf every package may import (it imports nothing)."""


class AtriumError(Exception):
    """Base of every Atrium error. ``code`` is stable: clients, logs and the gateway's one
    mapping to HTTP (``web/errors.py``) read it."""

    code = "atrium_error"
