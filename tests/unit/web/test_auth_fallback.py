"""The fallback key cache: served as the database last answered, bounded in age and size."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tenants.errors import InvalidKeyError, TenantSuspendedError
from tenants.schemas import AuthContext, Quotas
from web.tenancy.auth_fallback import KnownKeys


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def ctx(key_id: str, tenant_id: str = "tn_a", expires_at: datetime | None = None) -> AuthContext:
    return AuthContext(
        tenant_id=tenant_id,
        tenant_name=tenant_id,
        key_id=key_id,
        weight=1.0,
        status="active",
        quotas=Quotas(),
        expires_at=expires_at,
    )


def test_a_key_is_served_until_max_age_after_the_database_last_confirmed_it() -> None:
    clock = Clock()
    known = KnownKeys(max_age_s=60.0, monotonic=clock)
    known.remember("sk-a", ctx("k1"))
    clock.t += 59.0
    assert known.lookup("sk-a") == ctx("k1")
    clock.t += 2.0
    assert known.lookup("sk-a") is None  # too old: the caller answers 503, not 200
    assert len(known) == 0


def test_a_sweep_confirmation_restarts_the_age_of_the_keys_still_valid_only() -> None:
    clock = Clock()
    known = KnownKeys(max_age_s=60.0, monotonic=clock)
    known.remember("sk-a", ctx("k1"))
    known.remember("sk-b", ctx("k2"))
    clock.t += 50.0
    asked = known.now()
    clock.t += 1.0  # the sweep's query takes a second
    known.confirm({"k1"}, asked)
    clock.t += 30.0  # 81 s after remember, 31 s after the confirmation
    assert known.lookup("sk-a") == ctx("k1")
    assert known.lookup("sk-b") is None


def test_a_key_revoked_elsewhere_just_before_an_outage_works_at_most_max_age() -> None:
    """The sweep confirmed it, then another process revoked it, then the database went away:
    nothing here can know, so the bound is the age since that last confirmation."""
    clock = Clock()
    known = KnownKeys(max_age_s=60.0, monotonic=clock)
    known.remember("sk-a", ctx("k1"))
    known.confirm({"k1"}, known.now())  # the last sweep before the outage
    clock.t += 1.5  # revoked elsewhere; the outage starts before the next sweep
    served = 0.0
    while known.lookup("sk-a") is not None:
        clock.t += 1.0
        served += 1.0
    assert 58.0 <= served <= 60.0


def test_refusals_stay_refused_with_their_reason() -> None:
    known = KnownKeys()
    known.remember("sk-a", ctx("k1"))
    known.remember("sk-b", ctx("k2", "tn_b"))
    known.remember("sk-c", ctx("k3", "tn_b"))
    assert known.refuse_keys({"k1": "revoked", "k2": "suspended"}) == {"tn_b": "suspended"}
    assert known.refuse_keys({"k2": "suspended"}) == {}  # only news is reported
    with pytest.raises(InvalidKeyError):
        known.lookup("sk-a")
    with pytest.raises(TenantSuspendedError):
        known.lookup("sk-b")
    assert known.lookup("sk-c") == ctx("k3", "tn_b")
    known.refuse_tenant("tn_b", "deleted")
    with pytest.raises(TenantSuspendedError, match="deleted"):
        known.lookup("sk-c")
    assert known.accepted_key_ids() == set()
    # A refused key is not revived by a later confirmation.
    known.confirm({"k1", "k2", "k3"}, known.now())
    with pytest.raises(InvalidKeyError):
        known.lookup("sk-a")


def test_only_keys_once_accepted_are_remembered_as_refused() -> None:
    known = KnownKeys()
    known.refuse("sk-never", "revoked")
    assert len(known) == 0 and known.lookup("sk-never") is None
    known.remember("sk-a", ctx("k1"))
    known.refuse("sk-a", "revoked")
    with pytest.raises(InvalidKeyError):
        known.lookup("sk-a")


def test_an_expired_key_is_refused_from_the_cache_too() -> None:
    known = KnownKeys()
    known.remember("sk-a", ctx("k1", expires_at=datetime.now(UTC) - timedelta(seconds=1)))
    with pytest.raises(InvalidKeyError, match="expired"):
        known.lookup("sk-a")


def test_the_cache_is_bounded_in_entries_oldest_verification_first() -> None:
    clock = Clock()
    known = KnownKeys(max_entries=3, monotonic=clock)
    for i in range(5):
        clock.t += 1.0
        known.remember(f"sk-{i}", ctx(f"k{i}"))
    assert len(known) == 3
    assert known.lookup("sk-0") is None and known.lookup("sk-1") is None
    assert known.lookup("sk-4") == ctx("k4")
    known.remember("sk-2", ctx("k2"))  # verified again: now the newest
    known.remember("sk-5", ctx("k5"))
    assert known.lookup("sk-3") is None and known.lookup("sk-2") == ctx("k2")


def test_keys_are_held_under_a_salted_digest_never_as_given() -> None:
    known = KnownKeys()
    known.remember("sk-secret-value", ctx("k1"))
    assert all("sk-secret-value" not in digest for digest in known._entries)
    assert KnownKeys()._digest("sk-x") != known._digest("sk-x")  # per-process salt
