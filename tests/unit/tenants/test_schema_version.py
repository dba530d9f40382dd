"""The rule for which schemas this code runs on: its head, or a newer one whose record names a
revision the code ships; never an older, empty, too-new or unrecorded one."""

from __future__ import annotations

import pytest

from tenants.schema_version import classify

KNOWN = {"0001", "0002", "0003"}


@pytest.mark.parametrize(
    ("revision", "marker", "kind", "ok"),
    [
        ("0003", "0002", "head", True),
        ("0004", "0003", "newer", True),  # the next release expanded
        ("0005", "0002", "newer", True),  # two expands declared compatible back to 0002
        ("0002", "0001", "older", False),
        (None, None, "empty", False),
        ("0005", "0005", "too_new", False),  # a contract step this code predates
        ("feedbeef", None, "unknown", False),  # nothing recorded how far back it reaches
    ],
)
def test_classify(revision: str | None, marker: str | None, kind: str, ok: bool) -> None:
    state = classify(revision, marker, "0003", KNOWN)
    assert (state.kind, state.ok) == (kind, ok)
