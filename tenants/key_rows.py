"""API key rows turned into the values services return: `KeyInfo` and `AuthContext`."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.errors import KeyNotFoundError
from tenants.key_policy import scopes_of
from tenants.models import ApiKey, Tenant
from tenants.schemas import AuthContext, KeyInfo
from tenants.tenant_service import quotas_of, tenant_info


def key_info(row: ApiKey) -> KeyInfo:
    return KeyInfo(
        id=row.id,
        tenant_id=row.tenant_id,
        name=row.name,
        prefix=row.prefix,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        last_used_at=row.last_used_at,
        expires_at=row.expires_at,
        replaced_by=row.replaced_by,
        scopes=scopes_of(row.scopes),
        models=row.models,
        requests_per_minute=row.requests_per_minute,
    )


def auth_context(key: ApiKey, tenant: Tenant) -> AuthContext:
    """What a verified key speaks for, with the key's own limits."""
    info = tenant_info(tenant)
    return AuthContext(
        tenant_id=info.id,
        tenant_name=info.name,
        key_id=key.id,
        weight=info.weight,
        status=info.status,
        quotas=quotas_of(tenant),
        expires_at=key.expires_at,
        scopes=tuple(scopes_of(key.scopes)),
        models=allowed_models(key.models, tenant.models),
        key_requests_per_minute=key.requests_per_minute,
    )


def allowed_models(
    key_models: list[str] | None, tenant_models: list[str] | None
) -> tuple[str, ...] | None:
    """The models a key may call: its own list within its tenant's allow-list (None: every)."""
    if tenant_models is None:
        return None if key_models is None else tuple(key_models)
    if key_models is None:
        return tuple(tenant_models)
    return tuple(name for name in key_models if name in tenant_models)


async def load_key(session: AsyncSession, key_id: str, *, lock: bool = False) -> ApiKey:
    """The key row (revoked or not); KeyNotFoundError when there is none."""
    stmt = select(ApiKey).where(ApiKey.id == key_id)
    row = await session.scalar(stmt.with_for_update() if lock else stmt)
    if row is None:
        raise KeyNotFoundError(f"key {key_id!r} not found")
    return row
