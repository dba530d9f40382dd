"""The FlashInfer modules an engine loads, per shape and GPU, as `atrium kernels build` compiles
them: the same wrapper requests the backend builds its wrappers from, and the compile targets."""

from __future__ import annotations

import pytest
import torch

from engine.attention.flashinfer_backend import FlashInferAttentionBackend, PagedWrapper
from engine.attention.kernel_plan import (
    KernelShape,
    WrapperKind,
    WrapperRequest,
    covers,
    parse_arch_list,
    planned_modules,
    wrapper_modules,
)

FA2 = ["fa2_prefill", "fa2_prefill_paged"]


class Recorder:
    """A wrapper factory that records what the backend asks FlashInfer for."""

    def __init__(self) -> None:
        self.requests: list[WrapperRequest] = []

    def __call__(
        self, kind: WrapperKind, workspace: torch.Tensor, use_tensor_cores: bool, kernel: str
    ) -> PagedWrapper:
        self.requests.append(WrapperRequest(kind, use_tensor_cores, kernel))
        return object()  # type: ignore[return-value]  # never planned here


def backend_modules(shape: KernelShape, major: int) -> list[str]:
    """What a backend of ``shape`` would load on a GPU of ``major``, from the wrappers it built."""
    recorder = Recorder()
    FlashInferAttentionBackend(
        shape.num_q_heads, shape.num_kv_heads, shape.head_dim, 16, shape.dtype, "cpu",
        workspace_bytes=64, use_decode_kernel=shape.use_decode_kernel,
        prefill_kernel=shape.prefill_kernel, wrapper_factory=recorder,
    )  # fmt: skip
    fa3 = major == 9 and shape.head_dim in (64, 128, 256)
    found = [m for r in recorder.requests for m in wrapper_modules(r, fa3)]
    return list(dict.fromkeys(found))


@pytest.mark.parametrize(
    ("heads", "head_dim", "kernel", "major", "expected"),
    [
        ((9, 3), 64, "fa2", 8, [*FA2, "decode"]),  # the default model: plain decode
        ((9, 3), 64, "auto", 9, ["fa3_prefill", "decode"]),
        ((9, 3), 64, "auto", 8, [*FA2, "decode"]),  # auto is FA2 off Hopper
        ((8, 2), 64, "auto", 9, ["fa3_prefill", *FA2]),  # tensor-core decode runs FA2's prefill
        ((32, 8), 128, "fa2", 9, FA2),
        ((32, 8), 96, "auto", 9, FA2),  # FA3 has no head size 96: auto stays FA2
        ((4, 4), 64, "fa3", 8, ["fa3_prefill", "decode"]),  # asked for, whatever the GPU
    ],
)
def test_the_plan_is_what_the_backend_loads(
    heads: tuple[int, int], head_dim: int, kernel: str, major: int, expected: list[str]
) -> None:
    shape = KernelShape(*heads, head_dim, torch.bfloat16, kernel)
    assert planned_modules(shape, (major,)) == expected
    assert backend_modules(shape, major) == expected


def test_without_the_decode_kernel_only_prefill_modules_load() -> None:
    shape = KernelShape(9, 3, 64, torch.float16, "fa2", use_decode_kernel=False)
    assert planned_modules(shape, (8,)) == FA2 == backend_modules(shape, 8)


def test_an_image_for_several_gpus_holds_each_ones_modules() -> None:
    shape = KernelShape(9, 3, 64, torch.bfloat16, "auto")
    assert planned_modules(shape, (8, 9)) == [*FA2, "decode", "fa3_prefill"]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"num_q_heads": 9, "num_kv_heads": 2}, "multiple"),
        ({"dtype": torch.float32}, "bfloat16 or float16"),
        ({"prefill_kernel": "fa4"}, "prefill kernel"),
        ({"head_dim": 0}, "head_dim"),
    ],
)
def test_shapes_flashinfer_cannot_run_are_refused(bad: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 64, **bad}
    with pytest.raises(ValueError, match=message):
        KernelShape(**fields)  # type: ignore[arg-type]


def test_arch_lists_read_as_flashinfer_targets() -> None:
    assert parse_arch_list("8.0;8.9;9.0") == ("8.0", "8.9", "9.0a")
    assert parse_arch_list(" 8.0, 9.0a 8.0 10.0f") == ("8.0", "9.0a", "10.0f")
    for bad in ("", "sm90", "9", "9.0b"):
        with pytest.raises(ValueError):
            parse_arch_list(bad)


@pytest.mark.parametrize(
    ("archs", "gpu", "runs"),
    [
        (("8.0",), (8, 6), True),  # A10 runs sm_80 code
        (("8.0",), (8, 9), True),
        (("8.9",), (8, 0), False),  # not backwards
        (("8.0", "8.9"), (9, 0), False),  # nor across majors
        (("9.0a",), (9, 0), True),
        (("9.0a",), (10, 0), False),  # arch-specific code runs on its own GPU only
        (("10.0f",), (10, 3), True),
    ],
)
def test_targets_cover_gpus_as_cuda_runs_them(
    archs: tuple[str, ...], gpu: tuple[int, int], runs: bool
) -> None:
    assert covers(archs, gpu) is runs
