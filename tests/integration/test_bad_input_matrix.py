"""Every field of every JSON body a client can send, with wrong types, values out of range, huge
values and odd unicode: a 4xx in the documented error shape, or an answer, never a 5xx.

The table is built from the request structs (msgspec type info), the field registry and the
admin routes' own body types, so a field added to any of them is covered without listing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from litestar import Litestar
from litestar.routes import HTTPRoute
from litestar.testing import TestClient

from tenants.database import Database
from tenants.server_secrets import ensure_admin_token
from tests.integration.gateway_fakes import KEY_A, MODEL, make_runtime, make_tenancy, settings
from tests.integration.pg_gateway import migrated_database
from tests.integration.test_admin_app import ADMIN_TOKEN, build_admin_app, migrated_sqlite
from tests.support.lora import make_adapter
from tests.support.postgres import pg_url
from web.app import create_app
from web.openai import schemas
from web.openai.fields import CHAT, COMPLETION, FIELDS
from web.openai.openapi_bodies import RAW_BODIES

# One value of each JSON kind; a value is a wrong type for a field that accepts none of its kinds.
SAMPLES: dict[str, Any] = {
    "str": "x",
    "int": 7,
    "float": 2.5,
    "bool": True,
    "list": [1],
    "object": {"k": 1},
}
# Kinds each msgspec type accepts from JSON (a literal or a date accepts only certain strings).
ACCEPTS: dict[type[mi.Type], set[str]] = {
    mi.StrType: {"str"},
    mi.IntType: {"int"},
    mi.FloatType: {"int", "float"},
    mi.BoolType: {"bool"},
    mi.ListType: {"list"},
    mi.TupleType: {"list"},
    mi.VarTupleType: {"list"},
    mi.SetType: {"list"},
    mi.DictType: {"object"},
    mi.StructType: {"object"},
    mi.AnyType: set(SAMPLES),
    mi.DateTimeType: {"int", "float"},  # bodies decode leniently: numbers are Unix times
}
# Values at the edges: out of range, huge, empty, odd unicode, deep. Any answer but a 5xx.
EDGES: list[Any] = [
    None,
    -1,
    0,
    2**63,
    -(10**30),
    1e308,
    -1e308,
    1e-320,
    "",
    " ",
    "\u202e\U0001f600\u0000\ufeff",
    "\ud800",  # a lone surrogate, escaped in the JSON text
    "x" * 100_000,
    [],
    [None, None],
    ["\U0001f600"] * 2_000,
    [[[[[[[[[[[]]]]]]]]]]],
    {},
    {"\U0001f600": -1e308},
    {str(i): i for i in range(2_000)},
]
ERROR_KEYS = {"message", "type", "param", "code"}
# The admin routes store what they accept (a transaction each): half the edges keep it short.
ADMIN_EDGES = [EDGES[i] for i in (0, 1, 3, 5, 9, 10, 11, 12, 14, 18)]


def _kinds(t: mi.Type) -> set[str]:
    if isinstance(t, mi.UnionType):
        return set().union(*(_kinds(m) for m in t.types))
    if isinstance(t, mi.Metadata):
        return _kinds(t.type)
    return ACCEPTS.get(type(t), set())


def _wrong_values(t: mi.Type) -> list[Any]:
    accepted = _kinds(t)
    wrong = [value for kind, value in SAMPLES.items() if kind not in accepted]
    members = t.types if isinstance(t, mi.UnionType) else (t,)
    if "str" not in accepted and any(
        isinstance(m, mi.LiteralType | mi.DateTimeType | mi.EnumType) for m in members
    ):
        wrong.append("not-one-of-them")
    return wrong


def _fields(struct: type[msgspec.Struct]) -> dict[str, mi.Type]:
    info = mi.type_info(struct)
    assert isinstance(info, mi.StructType)
    return {f.encode_name: f.type for f in info.fields}


def _cases(
    base: dict[str, Any], fields: dict[str, mi.Type], edges: list[Any] = EDGES
) -> Iterator[tuple[str, Any, bool]]:
    """(field, value, must_refuse) for every field: wrong types must be refused; edges need
    only not fail."""
    for name, t in fields.items():
        for value in _wrong_values(t):
            yield name, value, True
        for value in edges:
            yield name, value, False
        if name in base:  # a required field sent as null
            yield name, None, not _accepts_null(t)


def _accepts_null(t: mi.Type) -> bool:
    types = t.types if isinstance(t, mi.UnionType) else (t,)
    return any(isinstance(m, mi.NoneType | mi.AnyType) for m in types)


def _send(client: TestClient[Litestar], method: str, path: str, body: Any) -> Any:
    """JSON with every non-ASCII character escaped (a lone surrogate cannot be UTF-8)."""
    content = json.dumps(body).encode()
    return client.request(
        method, path, content=content, headers={"content-type": "application/json"}
    )


def _check(response: Any, field: str, value: Any, must_refuse: bool) -> None:
    where = f"{field}={json.dumps(value)[:60]} -> {response.status_code} {response.text[:200]}"
    assert response.status_code < 500, where
    if must_refuse:
        assert 400 <= response.status_code < 500, where
    html = response.headers.get("content-type", "").startswith("text/html")
    if response.status_code >= 400 and not html:  # the console's forms answer with a page
        error = response.json()["error"]
        assert set(error) == ERROR_KEYS and isinstance(error["message"], str), where
        assert isinstance(error["type"], str) and error["type"], where


# -- the tenant API ---------------------------------------------------------------------------

# A valid body per tenant route that decodes its own body (web.openai.openapi_bodies lists them
# all).
VALID_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    },
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2]},
}
# Routes whose valid body needs stored state, with the test that covers their bad bodies.
ELSEWHERE = {
    "/v1/batches": "an uploaded file on SQL tenancy: tests/integration/test_batch_api.py",
}
ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}
BASES = {
    path: (struct, ENDPOINTS.get(path), VALID_BODIES[path])
    for path, (struct, _, _) in RAW_BODIES.items()
    if path not in ELSEWHERE
}


@pytest.fixture(scope="module")
def tenant_client(tiny_llama_dir: Path) -> Iterator[TestClient[Litestar]]:
    runtime, _ = make_runtime(tiny_llama_dir)
    app = create_app(settings(), engine=runtime, store=make_tenancy(), include_admin=False)
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {KEY_A}"
        yield client


@pytest.mark.parametrize("path", sorted(BASES))
def test_every_tenant_api_field_refuses_bad_values_with_a_4xx(
    tenant_client: TestClient[Litestar], path: str
) -> None:
    struct, endpoint, base = BASES[path]
    fields = _fields(struct)
    # Registry fields the struct does not carry (refused or default-only) get the edges too.
    for name, rule in FIELDS.items():
        if endpoint is not None and endpoint in rule.endpoints and name not in fields:
            fields[name] = mi.AnyType()
    assert base.keys() <= fields.keys()
    assert tenant_client.post(path, json=base).status_code == 200
    checked = 0
    for field, value, must_refuse in _cases(base, fields):
        body = {**base, field: value}
        _check(_send(tenant_client, "POST", path, body), field, value, must_refuse)
        checked += 1
    # Nested: every message field, stream_options' fields.
    message_fields = _fields(schemas.ChatMessage)
    if "messages" in fields:
        for field, value, must_refuse in _cases({"role": "user"}, message_fields):
            message = {"role": "user", "content": "hi", field: value}
            response = _send(tenant_client, "POST", path, {**base, "messages": [message]})
            _check(response, f"messages[0].{field}", value, must_refuse)
            checked += 1
    for field, value, must_refuse in _cases({}, _fields(schemas.StreamOptions)):
        if "stream_options" not in fields:
            break
        response = _send(tenant_client, "POST", path, {**base, "stream_options": {field: value}})
        _check(response, f"stream_options.{field}", value, must_refuse)
        checked += 1
    assert checked > 40


def test_unknown_and_misspelled_fields_are_named_in_a_400(
    tenant_client: TestClient[Litestar],
) -> None:
    for path, (_, _, base) in BASES.items():
        for name in ("temprature", "tenant_id", "\U0001f600", "x" * 5_000):
            response = _send(tenant_client, "POST", path, {**base, name: 1})
            _check(response, name, 1, True)
            assert response.status_code == 400


# -- the admin API ----------------------------------------------------------------------------


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def admin_client(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_dir: Path,
) -> Iterator[TestClient[Litestar]]:
    """The admin API on each database: PostgreSQL refuses some text SQLite stores (NUL).
    A LoRA adapter's valid ``path`` is a real adapter folder on this machine."""
    adapter = tmp_path_factory.mktemp("matrix_adapter") / "adapter"
    VALID["path"] = str(make_adapter(tiny_llama_dir, adapter, 3, 2, 4.0, ["q_proj"]))
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            url = migrated_sqlite(tmp_path_factory.mktemp("matrix") / "admin.db")
        else:
            url = pg_url(stack.enter_context(migrated_database()))
            asyncio.run(_store_admin_token(url))
        client = stack.enter_context(TestClient(build_admin_app(url)))
        client.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        yield client


async def _store_admin_token(url: str) -> None:
    db = await Database.connect(url)
    try:
        await ensure_admin_token(db, ADMIN_TOKEN)
    finally:
        await db.close()


def _body_routes(app: Litestar) -> list[tuple[str, str, Any]]:
    """(method, path template, body type) of every route that takes a JSON body."""
    found = []
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        for handler in route.route_handlers:
            data = handler.parsed_fn_signature.parameters.get("data")
            if data is not None:
                for method in sorted(handler.http_methods):
                    found.append((method, route.path, data.annotation))
    return found


def _struct_of(annotation: Any) -> type[msgspec.Struct] | None:
    info = mi.type_info(annotation)
    types = info.types if isinstance(info, mi.UnionType) else (info,)
    return next((t.cls for t in types if isinstance(t, mi.StructType)), None)


def test_every_admin_api_body_field_refuses_bad_values_with_a_4xx(
    admin_client: TestClient[Litestar],
) -> None:
    tenant = admin_client.post("/admin/v1/tenants", json={"name": "matrix"}).json()
    key = admin_client.post(f"/admin/v1/tenants/{tenant['id']}/keys", json={}).json()
    ids = {"tenant_id": tenant["id"], "key_id": key["id"], "model": "matrix-model"}
    routes = _body_routes(admin_client.app)
    assert {p for _, p, _ in routes} >= {"/admin/v1/tenants", "/admin/v1/prices/{model:path}"}
    checked = 0
    for method, template, annotation in routes:
        path = template
        for name, value in ids.items():
            path = path.replace(f"{{{name}:str}}", value).replace(f"{{{name}:path}}", value)
        assert "{" not in path, template
        struct = _struct_of(annotation)
        if struct is None:  # a plain mapping (the console's forms): edges of the whole body
            for value in ADMIN_EDGES:
                response = _send(admin_client, method, path, value)
                _check(response, f"{template} body", value, False)
                checked += 1
            continue
        fields = _fields(struct)
        base = _required(struct)
        # The base body is valid (a key rotated once already answers 409, not 400).
        assert _send(admin_client, method, path, base()).status_code in (200, 201, 409), template
        for field, value, must_refuse in _cases(base(), fields, ADMIN_EDGES):
            response = _send(admin_client, method, path, {**base(), field: value})
            _check(response, f"{method} {template} {field}", value, must_refuse)
            checked += 1
            for inner_name, inner in _nested_structs(fields.get(field)):
                for inner_field, inner_value, inner_refuse in _cases({}, inner, ADMIN_EDGES):
                    body = {**base(), field: {inner_field: inner_value}}
                    response = _send(admin_client, method, path, body)
                    where = f"{method} {template} {field}.{inner_name}{inner_field}"
                    _check(response, where, inner_value, inner_refuse)
                    checked += 1
    assert checked > 500


VALID: dict[str, str] = {"currency": "USD", "text": "You are a helpful assistant."}
_serial = iter(range(10**9))


def _required(struct: type[msgspec.Struct]) -> Any:
    """A maker of the smallest valid body: each required field with a valid value (names
    unique, so that creating one twice is no conflict)."""
    info = mi.type_info(struct)
    assert isinstance(info, mi.StructType)
    required = [f for f in info.fields if f.required]

    def make() -> dict[str, Any]:
        body: dict[str, Any] = {}
        for f in required:
            kinds = _kinds(f.type)
            if f.encode_name in VALID:
                body[f.encode_name] = VALID[f.encode_name]
            elif "str" in kinds:
                body[f.encode_name] = f"matrix-{next(_serial)}"
            else:
                body[f.encode_name] = 1 if "int" in kinds else True
        return body

    return make


def _nested_structs(t: mi.Type | None) -> Iterator[tuple[str, dict[str, mi.Type]]]:
    if t is None:
        return
    types = t.types if isinstance(t, mi.UnionType) else (t,)
    for member in types:
        if isinstance(member, mi.StructType):
            yield "", _fields(member.cls)
