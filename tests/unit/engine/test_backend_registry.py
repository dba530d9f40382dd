"""Device resolution and attention backend selection, with CUDA's availability monkeypatched."""

from __future__ import annotations

import importlib
import json
import sys
import types
from typing import Any

import pytest
import torch

from bench import gpu_bench
from engine.attention.flashinfer_backend import flashinfer_wrapper, load_flashinfer
from engine.attention.registry import BackendUnavailableError, backend_name_for, create_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.device import (
    DeviceUnavailableError,
    cpu_has_bf16_dot,
    resolve_device,
    resolve_dtype,
)
from engine.model.config import ModelConfig

MODEL = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


def fake_cuda(monkeypatch: pytest.MonkeyPatch, available: bool, count: int = 1) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count if available else 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def hide_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail


def test_auto_is_cpu_without_cuda_and_cuda_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, available=False)
    assert resolve_device("auto") == torch.device("cpu")
    fake_cuda(monkeypatch, available=True)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device(" CUDA ") == torch.device("cuda", 0)


def test_explicit_cuda_without_a_gpu_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, available=False)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceUnavailableError, match="CUDA is not available") as info:
        resolve_device("cuda")
    assert info.value.code == "device_unavailable"
    fake_cuda(monkeypatch, available=True, count=2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(DeviceUnavailableError, match="2 visible"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("spec", ["tpu", "mps", "gpu0", ""])
def test_unknown_devices_are_rejected(spec: str) -> None:
    with pytest.raises(ValueError, match="device"):
        resolve_device(spec)


def test_dtype_auto_follows_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    for avx512_bf16, amx, expected in [
        (True, False, torch.bfloat16),
        (False, True, torch.bfloat16),
        (False, False, torch.float32),  # bf16 would be widened inside every product
    ]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert cpu_has_bf16_dot() == (expected == torch.bfloat16)
        assert resolve_dtype("auto", torch.device("cpu")) == expected
        assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", torch.device("cpu"))


def test_cpu_gets_the_torch_backend() -> None:
    backend = create_backend(torch.device("cpu"), MODEL, page_size=16, dtype=torch.float32)
    assert isinstance(backend, TorchAttentionBackend)
    assert backend_name_for(torch.device("cpu")) == "torch"
    assert backend_name_for(torch.device("cuda", 0)) == "flashinfer"
    with pytest.raises(BackendUnavailableError, match="'mps'"):
        backend_name_for(torch.device("mps"))


def test_cuda_without_flashinfer_names_the_gpu_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    hide_flashinfer(monkeypatch)
    with pytest.raises(BackendUnavailableError, match=r"atrium\[gpu\]") as info:
        create_backend(torch.device("cuda", 0), MODEL, page_size=16, dtype=torch.bfloat16)
    assert info.value.code == "backend_unavailable"
    with pytest.raises(BackendUnavailableError, match=r"flashinfer-python==0\.7\.2\.post1"):
        load_flashinfer()


def test_flashinfer_refuses_cpu_and_float32() -> None:
    with pytest.raises(BackendUnavailableError, match="CUDA device"):
        create_backend(
            torch.device("cpu"), MODEL, page_size=16, dtype=torch.bfloat16, name="flashinfer"
        )
    with pytest.raises(BackendUnavailableError, match="bfloat16 or float16"):
        create_backend(torch.device("cuda", 0), MODEL, page_size=16, dtype=torch.float32)


def test_a_named_backend_overrides_the_device_default() -> None:
    backend = create_backend(
        torch.device("cuda", 0), MODEL, page_size=16, dtype=torch.bfloat16, name="torch"
    )
    assert isinstance(backend, TorchAttentionBackend)  # the reference backend runs on CUDA too
    with pytest.raises(ValueError, match="unknown attention backend 'triton'"):
        create_backend(torch.device("cpu"), MODEL, page_size=16, dtype=torch.float32, name="triton")


def test_default_wrappers_are_flashinfers_nhd_wrappers(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def recorder(kind: str) -> Any:
        def make(*args: Any, **kwargs: Any) -> object:
            made.append((kind, args, kwargs))
            return object()

        return make

    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = recorder("prefill")  # type: ignore[attr-defined]
    module.BatchDecodeWithPagedKVCacheWrapper = recorder("decode")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    workspace = torch.zeros(8, dtype=torch.uint8)
    flashinfer_wrapper("prefill", workspace, True, "fa2")
    flashinfer_wrapper("decode", workspace, False, "auto")
    assert made == [
        ("prefill", (workspace,), {"kv_layout": "NHD", "backend": "fa2"}),
        ("decode", (workspace,), {"kv_layout": "NHD", "use_tensor_cores": False, "backend": "fa2"}),
    ]


def test_a_broken_flashinfer_import_names_its_real_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_import(name: str) -> types.ModuleType:
        raise ModuleNotFoundError("No module named 'pynvml'", name="pynvml")

    monkeypatch.setattr(importlib, "import_module", failing_import)
    with pytest.raises(BackendUnavailableError, match="import failed") as info:
        load_flashinfer()
    assert "No module named 'pynvml'" in str(info.value)
    assert "not installed" not in str(info.value)


def test_gpu_bench_smoke_reports_the_backend_it_ran(capsys: pytest.CaptureFixture[str]) -> None:
    # The bench builds its backend through the registry; on CPU that is the torch backend.
    assert gpu_bench.main(["--smoke", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "torch" and report["device"] == "cpu"
    assert report["model"]["params"] > 0
    prefill = report["prefill"]
    assert prefill["tokens"] == prefill["num_seqs"] * prefill["seq_len"]
    assert prefill["tok_per_s"] > 0 and 0 < prefill["mfu"] < 1
    assert [row["batch"] for row in report["decode"]] == list(gpu_bench.SMOKE.decode_batches)
    for row in report["decode"]:
        assert row["tok_per_s"] > 0 and 0 < row["bandwidth_util"] < 1
        assert row["bytes_per_step"] > report["model"]["weight_bytes"]  # weights plus KV reads
        # The graph step fed the ids of the step before: read back first, or overlapped.
        assert row["graph_read_step_ms"] > 0 and row["overlap_step_ms"] > 0
