"""Key format: parsing, hashing and the entropy of generated keys."""

from __future__ import annotations

import pytest

from tenants.errors import InvalidKeyError
from tenants.key_format import generate_key, hash_key, key_matches, parse_prefix

SECRET = b"s" * 32


def test_generated_keys_parse_back_to_their_prefix_and_differ() -> None:
    keys = [generate_key() for _ in range(50)]
    assert all(parse_prefix(key) == prefix for prefix, key in keys)
    assert len({key for _, key in keys}) == len({prefix for prefix, _ in keys}) == 50


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "sk-atr-",
        "sk-abc-0123456789-" + "a" * 40,
        "sk-atr-0123456789-" + "a" * 39,
        "sk-atr-0123456789-" + "A" * 40,
        "sk-atr-012345678-" + "a" * 41,
    ],
)
def test_malformed_keys_are_invalid(bad: str) -> None:
    with pytest.raises(InvalidKeyError):
        parse_prefix(bad)


def test_hash_depends_on_the_server_secret() -> None:
    _, key = generate_key()
    stored = hash_key(SECRET, key)
    assert key_matches(SECRET, key, stored)
    assert not key_matches(b"t" * 32, key, stored)
    assert not key_matches(SECRET, key[:-1] + ("0" if key[-1] != "0" else "1"), stored)
