"""What crosses between a gateway and an engine: the body's tenant fields and the token check.

A gateway names the tenant in the body, where routers pass it through (they drop unknown
headers): ``cache_salt`` is the tenant's cache namespace (the field vLLM and the routers know),
``atrium_tenant_weight`` and ``atrium_kv_cache_share`` its fair-share weight and cache share,
``atrium_allow_public_prefix`` whether it may reuse public prefixes. ``atrium_prompt_token_ids``
carries the prompt exactly as the gateway counted it (``prompt`` stays text, for the router's
prefix matching) and ``atrium_sampling`` every sampling setting; ``atrium_lora_id`` and
``atrium_lora_path`` name a registered LoRA adapter and its folder; ``atrium_background`` marks
offline work (a Batch API line) whose steps yield to other prompts; ``atrium_tenant_requests``
is the gateway's count of the tenant's requests, which the engine's fair share ranks bursts by.
The engine honours these only from a caller holding the engine token; everything else is refused
before the body is read. Of OpenAI's fields, ``n`` (up to the tenant API's limit) sends a prompt's
choices as one request, placed whole on one engine that computes the prompt once; its stream to a
gateway names each chunk's choice counts (``atrium_choice_usage``, ``web/openai/sse.py``).
"""

from __future__ import annotations

import hmac
import math
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import Any

import msgspec

from engine.sampling_params import SamplingParams
from tenants.lora_adapters import MAX_NAME_CHARS, LoraAdapterInfo
from web.ops.errors import ApiError, bad_request

MAX_CACHE_SALT_CHARS = 256
MAX_TENANT_REQUESTS = 1_000_000
STATE_PATH = "/atrium/v1/state"  # the engine's live snapshot (an Atrium extension)


class TenantFields(msgspec.Struct, kw_only=True):
    """The tenant extension a gateway adds to an OpenAI body (read from the same JSON object as
    the OpenAI request itself, whose unknown fields are ignored)."""

    cache_salt: str | None = None
    atrium_tenant_weight: float | None = None
    atrium_kv_cache_share: float | None = None
    atrium_allow_public_prefix: bool | None = None
    atrium_prompt_token_ids: list[int] | None = None
    atrium_sampling: dict[str, Any] | None = None
    atrium_lora_id: str | None = None
    atrium_lora_path: str | None = None
    atrium_background: bool | None = None
    atrium_tenant_requests: int | None = None


TENANT_FIELDS = TenantFields.__struct_fields__

# What an engine's routes honour besides the tenant extension (``sampling_params`` of the OpenAI
# schemas reads these), and the values it takes for fields it honours only at their default
# (routers add some of these to every body they forward).
HONOURED_FIELDS = frozenset(
    {
        "model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens",
        "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos", "stream",
        "stream_options",
        "user", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
        "stop_token_ids", "include_stop_str_in_output", "min_tokens", "logprobs",
        "top_logprobs", *TENANT_FIELDS,
    }
)  # fmt: skip
DEFAULT_ONLY_FIELDS: dict[str, object] = {
    "best_of": 1, "echo": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "add_generation_prompt": True,
}  # fmt: skip
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})


def check_fields(raw: object) -> None:
    """A 400 ``unsupported_parameter`` naming the first field this engine would not honour."""
    if not isinstance(raw, dict):
        raise bad_request("The body must be a JSON object.")
    for name, value in raw.items():
        if value is None or name in HONOURED_FIELDS:
            continue
        if name in DEFAULT_ONLY_FIELDS and value == DEFAULT_ONLY_FIELDS[name]:
            continue
        raise bad_request(
            f"`{name}` is not supported by the engine API.", name, code="unsupported_parameter"
        )
    options = raw.get("stream_options")
    for name in options if isinstance(options, dict) else ():
        if name not in STREAM_OPTIONS:
            param = f"stream_options.{name}"
            raise bad_request(
                f"`{param}` is not supported by the engine API.", param, "unsupported_parameter"
            )


def check_token(header: str, expected: str) -> None:
    """401 unless ``header`` is ``Bearer <expected>`` (compared in constant time)."""
    scheme, _, given = header.partition(" ")
    # Bytes: compare_digest refuses non-ASCII strings, and any caller can send them.
    given_bytes = given.strip().encode("utf-8", "backslashreplace")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given_bytes, expected.encode()):
        raise ApiError(
            401,
            "This engine answers only its gateways: send `Authorization: Bearer <engine token>`.",
            code="invalid_engine_token",
            headers={"WWW-Authenticate": "Bearer"},
        )


def tenant_id_of(fields: TenantFields) -> str:
    salt = fields.cache_salt
    if salt is None:
        return "default"
    if not salt or len(salt) > MAX_CACHE_SALT_CHARS or not salt.isprintable():
        raise bad_request(
            f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} printable characters", "cache_salt"
        )
    return salt


def weight_of(fields: TenantFields) -> float:
    weight = fields.atrium_tenant_weight
    if weight is None:
        return 1.0
    if not (math.isfinite(weight) and weight > 0):
        raise bad_request("atrium_tenant_weight must be a positive number", "atrium_tenant_weight")
    return weight


def tenant_requests_of(fields: TenantFields) -> int:
    count = fields.atrium_tenant_requests
    if count is None:
        return 0
    if not 0 <= count <= MAX_TENANT_REQUESTS:
        raise bad_request(
            f"atrium_tenant_requests must be in [0, {MAX_TENANT_REQUESTS}]",
            "atrium_tenant_requests",
        )
    return count


def cache_share_of(fields: TenantFields) -> float | None:
    share = fields.atrium_kv_cache_share
    if share is not None and not (math.isfinite(share) and 0 < share <= 1):
        raise bad_request("atrium_kv_cache_share must be in (0, 1]", "atrium_kv_cache_share")
    return share


def sampling_of(fields: TenantFields) -> SamplingParams | None:
    """The gateway's exact sampling settings, or None when the body has only OpenAI's fields."""
    if fields.atrium_sampling is None:
        return None
    try:
        return msgspec.convert(fields.atrium_sampling, SamplingParams)
    except msgspec.ValidationError as exc:
        raise bad_request(f"Invalid atrium_sampling: {exc}", "atrium_sampling") from exc


def sampling_to_wire(params: SamplingParams) -> dict[str, Any]:
    """``params`` as JSON-ready data (``sampling_of`` reads it back)."""
    data: dict[str, Any] = msgspec.to_builtins(params)
    return data


def checked_ids(ids: list[int], tokenizer: object, param: str) -> list[int]:
    """``ids`` when every one is a token of ``tokenizer``'s vocabulary; a 400 otherwise."""
    vocab_size = int(getattr(tokenizer, "vocab_size", 2**31))
    if not ids or any(not 0 <= token < vocab_size for token in ids):
        raise bad_request(f"{param} must be a non-empty list of ids below {vocab_size}", param)
    return ids


def adapter_of(fields: TenantFields) -> LoraAdapterInfo | None:
    """The LoRA adapter the gateway resolved for this request (its registration id and folder),
    or None for the base model; both fields or neither."""
    adapter_id, path = fields.atrium_lora_id, fields.atrium_lora_path
    if adapter_id is None and path is None:
        return None
    if adapter_id is None or not 0 < len(adapter_id) <= MAX_NAME_CHARS:
        raise bad_request(f"atrium_lora_id must be 1 to {MAX_NAME_CHARS} characters",
                          "atrium_lora_id")  # fmt: skip
    if path is None or not PurePosixPath(path).is_absolute() or "\x00" in path:
        raise bad_request("atrium_lora_path must be an absolute folder path", "atrium_lora_path")
    return LoraAdapterInfo(
        id=adapter_id,
        name=adapter_id,
        path=path,
        tenant_id=None,
        created_at=datetime.fromtimestamp(0, UTC),
        created_by="gateway",
    )
