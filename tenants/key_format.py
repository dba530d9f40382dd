"""API key format ``sk-atr-<prefix>-<secret>``, generation, parsing and HMAC-SHA256 hashing.

The prefix (public, unique) finds the row; the HMAC of the whole key proves possession.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from tenants.errors import InvalidKeyError

KEY_SCHEME = "sk-atr-"
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
PREFIX_LEN = 10
SECRET_LEN = 40  # 40 base-36 characters: about 206 bits of entropy


def _random_text(length: int) -> str:
    return "".join(secrets.choice(ALPHABET) for _ in range(length))


def new_id(kind: str) -> str:
    """A short random identifier such as ``tn_3k9…`` (12 base-36 characters)."""
    return f"{kind}_{_random_text(12)}"


def generate_key() -> tuple[str, str]:
    """A fresh ``(prefix, full key)``."""
    prefix = _random_text(PREFIX_LEN)
    return prefix, f"{KEY_SCHEME}{prefix}-{_random_text(SECRET_LEN)}"


def parse_prefix(key: str) -> str:
    """The lookup prefix of a well-formed key; InvalidKeyError otherwise."""
    body = key[len(KEY_SCHEME) :] if key.startswith(KEY_SCHEME) else ""
    prefix, dash, rest = body.partition("-")
    well_formed = (
        len(prefix) == PREFIX_LEN
        and dash == "-"
        and len(rest) == SECRET_LEN
        and all(c in ALPHABET for c in prefix + rest)
    )
    if not well_formed:
        raise InvalidKeyError("malformed API key")
    return prefix


def hash_key(server_secret: bytes, key: str) -> str:
    return hmac.new(server_secret, key.encode("ascii"), hashlib.sha256).hexdigest()


def key_matches(server_secret: bytes, key: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_key(server_secret, key), stored_hash)
