"""Validation of request-shaped structs, from code and from JSON."""

from __future__ import annotations

from datetime import datetime

import msgspec
import pytest

from tenants.errors import InvalidInputError
from tenants.records import PriceSet, UsageEvent
from tenants.schemas import (
    Quotas,
    QuotasPatch,
    TenantCreate,
    TenantPatch,
    Usage,
    check_tenant_name,
)


@pytest.mark.parametrize(
    "build",
    [
        lambda: TenantCreate(name=""),
        lambda: TenantCreate(name="x", weight=0.0),
        lambda: TenantCreate(name="x", weight=float("nan")),
        lambda: Quotas(requests_per_minute=-1),
        lambda: Quotas(kv_cache_share=1.5),
        lambda: Usage(prompt_tokens=1, completion_tokens=0, cached_tokens=2),
        lambda: PriceSet(
            input_per_million=1, cached_input_per_million=1, output_per_million=1, currency="usd"
        ),
        lambda: UsageEvent(
            request_id="r",
            tenant_id="t",
            key_id=None,
            model="m",
            prompt_tokens=1,
            cached_tokens=0,
            completion_tokens=1,
            status="ok",
            started_at=datetime(2030, 1, 1),
            finished_at=datetime(2030, 1, 1),
        ),
    ],
)
def test_invalid_values_are_refused(build) -> None:
    with pytest.raises(InvalidInputError):
        build()


def test_json_bodies_decode_with_partial_patches_and_reject_unknown_fields() -> None:
    patch = msgspec.json.decode(b'{"quotas": {"max_prompt_tokens": null}}', type=TenantPatch)
    assert isinstance(patch.quotas, QuotasPatch)
    merged = patch.quotas.apply(Quotas(max_prompt_tokens=5, requests_per_minute=9))
    assert merged == Quotas(requests_per_minute=9)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"name": "a", "tenant": "b"}', type=TenantCreate)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"status": "deleted"}', type=TenantPatch)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"name": "a", "weight": -1}', type=TenantCreate)


@pytest.mark.parametrize(
    "build",
    [
        lambda: Quotas(requests_per_minute=2**63),  # past SQLite's and PostgreSQL's BIGINT
        lambda: Quotas(monthly_token_budget=2**53 + 1),
        lambda: PriceSet(
            input_per_million=10**30, cached_input_per_million=0, output_per_million=0
        ),
        lambda: TenantCreate(name="a\x00b"),  # PostgreSQL text cannot hold NUL
        lambda: TenantCreate(name="tab\there"),
        lambda: TenantCreate(name="lone \ud800 surrogate"),
    ],
)
def test_counts_past_2_53_and_names_with_control_characters_are_refused(build) -> None:
    with pytest.raises(InvalidInputError):
        build()


def test_the_largest_count_is_accepted() -> None:
    assert Quotas(monthly_token_budget=2**53).monthly_token_budget == 2**53


@pytest.mark.parametrize("name", ["acme", "acme-prod", "a", "team.eu_2", "0x", "a" * 63])
def test_tenant_names_are_slugs(name: str) -> None:
    check_tenant_name(name)


@pytest.mark.parametrize(
    "name",
    ["bad name!", "Acme", "-acme", ".acme", "a" * 64, "Åsa", "tn_abc123", "acme\n", "", " acme"],
)
def test_other_tenant_names_are_refused_with_the_rule(name: str) -> None:
    with pytest.raises(InvalidInputError, match="lowercase letters, digits") as refused:
        check_tenant_name(name)
    assert refused.value.param == "name"
