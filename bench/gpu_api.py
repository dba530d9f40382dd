"""FlashInfer's wrapper signatures read from its sources with ``ast`` (no import, no GPU), and
bound to recorded calls: how a CPU test catches drift between our calls and the pinned FlashInfer.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# The wrappers the backend builds, by source file, and the methods it calls. ``plan`` forwards
# its keywords to ``_plan_impl`` in the decode wrapper, so that is where they are checked.
WRAPPERS = {
    "prefill": ("prefill.py", "BatchPrefillWithPagedKVCacheWrapper"),
    "decode": ("decode.py", "BatchDecodeWithPagedKVCacheWrapper"),
}
METHODS = ("__init__", "plan", "_plan_impl", "run")
ParamList = list[list[str | bool]]  # [name, kind, has_default]


def _params(fn: ast.FunctionDef) -> ParamList:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    first_default = len(positional) - len(a.defaults)
    out: ParamList = []
    for i, arg in enumerate(positional):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append([arg.arg, kind, i >= first_default])
    if a.vararg:
        out.append([a.vararg.arg, "VAR_POSITIONAL", False])
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append([arg.arg, "KEYWORD_ONLY", default is not None])
    if a.kwarg:
        out.append([a.kwarg.arg, "VAR_KEYWORD", False])
    return out


def extract_api(package: Path) -> dict[str, dict[str, ParamList]]:
    """Each wrapper's methods as parameter lists; the last ``def`` of a name wins (overloads
    come first, the implementation last)."""
    api: dict[str, dict[str, ParamList]] = {}
    for kind, (filename, cls_name) in WRAPPERS.items():
        tree = ast.parse((package / filename).read_text(encoding="utf-8"))
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
        methods: dict[str, ParamList] = {}
        for node in cls.body:
            if isinstance(node, ast.FunctionDef) and node.name in METHODS:
                methods[node.name] = _params(node)
        api[kind] = methods
    return api


def signature(params: ParamList) -> inspect.Signature:
    return inspect.Signature(
        [
            inspect.Parameter(
                str(name),
                getattr(inspect.Parameter, str(kind)),
                default=None if has_default else inspect.Parameter.empty,
            )
            for name, kind, has_default in params
        ]
    )


def check_call(
    api: Mapping[str, Mapping[str, ParamList]],
    kind: str,
    method: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> None:
    """Raise ``TypeError`` when the call would not bind to the method (``self`` included)."""
    methods = api[kind]
    signature(methods[method]).bind(object(), *args, **kwargs)
    if method == "plan" and "_plan_impl" in methods:
        forwards = methods["plan"][-1][1] == "VAR_KEYWORD"
        if forwards:
            signature(methods["_plan_impl"]).bind(object(), *args, **kwargs)
