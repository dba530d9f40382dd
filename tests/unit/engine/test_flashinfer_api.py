"""Every constructor, plan and run call the FlashInfer backend makes binds to the pinned FlashInfer.

The signatures come from ``flashinfer_api.json``, read with ``ast`` from flashinfer-python
0.7.2.post1's sources by ``bench.gpu_bundle`` (CI has no FlashInfer: it would pull a CUDA torch).
Where the bundle or FlashInfer itself is present, the vendored list is checked against them too.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.gpu_api import check_call, extract_api
from engine.attention.flashinfer_backend import FlashInferAttentionBackend
from engine.attention.metadata import SeqSlice
from tests.unit.engine.test_flashinfer_plan import (
    PAGE,
    D,
    Kernels,
    meta_for,
    random_step,
    run_step,
)

API = json.loads((Path(__file__).parent / "flashinfer_api.json").read_text(encoding="utf-8"))
BUNDLE_API = Path(__file__).parents[3] / ".gpu_bundle" / "flashinfer_api.json"
WRAPPER_CLASSES = {
    "prefill": "BatchPrefillWithPagedKVCacheWrapper",
    "decode": "BatchDecodeWithPagedKVCacheWrapper",
}


def recorded_calls() -> list[tuple[str, str, tuple[Any, ...], dict[str, Any]]]:
    """Mixed steps, tensor-core and plain-kernel decodes, and decodes on the prefill wrapper."""
    calls = []
    for hq, hkv, use_decode_kernel in [(4, 2, True), (4, 1, True), (6, 2, True), (4, 2, False)]:
        kernels = Kernels()
        backend = FlashInferAttentionBackend(
            hq, hkv, D, PAGE, torch.float32, "cpu", workspace_bytes=64,
            use_decode_kernel=use_decode_kernel, wrapper_factory=kernels,
        )  # fmt: skip
        if hkv == 2 and hq == 4:  # run_step's reference layers are built for 4/2 heads
            run_step(backend, random_step(random.Random(1)), num_layers=2)
            run_step(backend, random_step(random.Random(2), decode_only=True), num_layers=2)
        else:
            backend.plan(meta_for([SeqSlice([0, 1], 5, 1)]))  # a decode-only plan
        for kind, wrapper in kernels.made.items():
            for method, made in wrapper.calls.items():
                calls += [(kind, method, args, kwargs) for args, kwargs in made]
    # CUDA-graph decode wrappers over fixed buffers, planned for a padded step.
    kernels = Kernels()
    backend = FlashInferAttentionBackend(
        4, 2, D, PAGE, torch.float32, "cpu", workspace_bytes=64, wrapper_factory=kernels
    )
    backend.fix_decode_sizes([1, 2], 8)
    backend.plan_fixed(meta_for([SeqSlice([0, 1], 5, 1), SeqSlice([2], 0, 1)]))
    for wrapper in kernels.fixed.values():
        for method, made in wrapper.calls.items():
            calls += [("decode", method, args, kwargs) for args, kwargs in made]
    return calls


CALLS = recorded_calls()


def test_the_recorded_calls_cover_every_method_of_both_wrappers() -> None:
    seen = {(kind, method) for kind, method, _, _ in CALLS}
    assert seen == {(k, m) for k in ("prefill", "decode") for m in ("__init__", "plan", "run")}


@pytest.mark.parametrize(("kind", "method", "args", "kwargs"), CALLS)
def test_each_call_binds_to_the_pinned_signature(
    kind: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    check_call(API, kind, method, args, kwargs)


@pytest.mark.parametrize(
    ("kind", "method", "kwargs"),
    [
        ("prefill", "plan", {"head_dim": 64}),  # the decode wrapper's name, not the prefill's
        ("decode", "plan", {"causal": True}),  # caught in _plan_impl, behind plan's **kwargs
        ("decode", "__init__", {"kernel": "fa2"}),
    ],
)
def test_a_drifted_call_does_not_bind(kind: str, method: str, kwargs: dict[str, Any]) -> None:
    good = next((a, k) for c, m, a, k in CALLS if (c, m) == (kind, method))
    with pytest.raises(TypeError):
        check_call(API, kind, method, good[0], {**good[1], **kwargs})


def test_the_ast_reader_takes_the_implementation_after_its_overloads(tmp_path: Path) -> None:
    for kind, cls in WRAPPER_CLASSES.items():
        (tmp_path / f"{kind}.py").write_text(
            f"class {cls}:\n"
            "    @overload\n    def run(self, q): ...\n"
            "    def run(self, q, kv, *args, out=None, **kw): ...\n"
            "    def plan(self, a, /, b=1, *, c): ...\n"
        )
    api = extract_api(tmp_path)
    assert api["prefill"]["run"] == [
        ["self", "POSITIONAL_OR_KEYWORD", False], ["q", "POSITIONAL_OR_KEYWORD", False],
        ["kv", "POSITIONAL_OR_KEYWORD", False], ["args", "VAR_POSITIONAL", False],
        ["out", "KEYWORD_ONLY", True], ["kw", "VAR_KEYWORD", False],
    ]  # fmt: skip
    assert api["decode"]["plan"][1:] == [
        ["a", "POSITIONAL_ONLY", False], ["b", "POSITIONAL_OR_KEYWORD", True],
        ["c", "KEYWORD_ONLY", False],
    ]  # fmt: skip


def test_the_vendored_signatures_match_the_bundles() -> None:
    if not BUNDLE_API.is_file():
        pytest.skip("no .gpu_bundle/flashinfer_api.json (python -m bench.gpu_bundle builds it)")
    assert json.loads(BUNDLE_API.read_text(encoding="utf-8")) == API


def test_each_call_binds_to_the_installed_flashinfer() -> None:
    try:
        flashinfer = importlib.import_module("flashinfer")
    except ImportError as exc:
        pytest.skip(f"flashinfer does not import here ({exc}); the vendored signatures stand in")
    for kind, method, args, kwargs in CALLS:
        cls = getattr(flashinfer, WRAPPER_CLASSES[kind])
        targets = [method, "_plan_impl"] if method == "plan" else [method]
        for name in targets:
            if hasattr(cls, name):
                inspect.signature(inspect.unwrap(getattr(cls, name))).bind(
                    object(), *args, **kwargs
                )
