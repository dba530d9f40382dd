"""Watching a step make its tensors: factories without ``device=``, host reads of tensor values
and generators made without a device, from the engine's device-generic step code (the CPU-only
kernels are not watched); and one set of requests that takes every sampling path at once.
Used by tests/unit/engine/test_device_placement.py on the CPU and tests/gpu on CUDA."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from engine.llm_engine import LLMEngine
from engine.outputs import GenerateRequest, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured.spec import GrammarSpec

ROOT = Path(__file__).parents[2]
# The step's device-generic code: whatever runs there runs on a GPU as written.
WATCHED = [
    ROOT / "engine" / name
    for name in (
        "llm_engine.py",
        "sampler.py",
        "sampling_table.py",
        "transfers.py",
        "overlap.py",
        "logprobs.py",
        "logits_processing.py",
        "model_runner.py",
        "attention/metadata.py",
        "structured/masks.py",
        "lora/batch.py",
        "lora/manager.py",
    )
]
FACTORIES = {
    torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full,
    torch.arange, torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye,
    torch.scalar_tensor,
}  # fmt: skip
HOST_READS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.cpu, torch.Tensor.numpy,
}  # fmt: skip
TORCH_DIR = str(Path(torch.__file__).parent)


def _caller() -> tuple[Path, str, int] | None:
    """The first frame outside torch and this file: (file, function, line), when watched."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith(TORCH_DIR) or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return None
    path = Path(frame.f_code.co_filename)
    return (path, frame.f_code.co_name, frame.f_lineno) if path in WATCHED else None


class StepAudit(TorchFunctionMode):
    """Records factories without a device and host reads, by the watched line that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.no_device: list[str] = []
        self.host_reads: Counter[tuple[str, str]] = Counter()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            where = _caller()
            if where is not None:
                self.no_device.append(f"{where[0].relative_to(ROOT)}:{where[2]} {func.__name__}")
        elif func in HOST_READS:
            where = _caller()
            if where is not None:
                self.host_reads[str(where[0].relative_to(ROOT)), where[1]] += 1
        return func(*args, **kwargs)


@contextmanager
def noted_generators() -> Iterator[list[str]]:
    """Generators made by watched code without a device, noted while the context is open (a
    stand-in subclass replaces ``torch.Generator``)."""
    real = torch.Generator
    made: list[str] = []

    class NotedGenerator(real):  # type: ignore[misc, valid-type]
        def __new__(cls, device: Any = None) -> Any:
            where = _caller()
            if device is None and where is not None:
                made.append(f"{where[0].relative_to(ROOT)}:{where[2]}")
            return real.__new__(cls) if device is None else real.__new__(cls, device=device)

    torch.Generator = NotedGenerator  # type: ignore[misc]
    try:
        yield made
    finally:
        torch.Generator = real  # type: ignore[misc]


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def every_path_requests(adapter: Path) -> list[GenerateRequest]:
    """Greedy (drafting from a prompt that repeats), unseeded and seeded sampling with filters,
    logprobs with alternatives, penalties with logit_bias and min_tokens, a JSON schema, and a
    LoRA adapter (the one at ``adapter``, named "a")."""
    prompt = [5, 6, 7, 8, 9, 10] * 4
    plain = {"max_tokens": 8, "ignore_eos": True}
    params = {
        "greedy": SamplingParams(temperature=0.0, **plain),
        "unseeded": SamplingParams(temperature=1.0, top_k=40, top_p=0.9, min_p=0.01, **plain),
        "seeded": SamplingParams(temperature=0.8, seed=7, **plain),
        "logprobs": SamplingParams(temperature=0.0, logprobs=3, **plain),
        "sampled_logprobs": SamplingParams(temperature=1.0, logprobs=0, **plain),
        "penalties": SamplingParams(
            temperature=0.7,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.4,
            logit_bias=((7, 3.0), (9, -2.0)),
            min_tokens=4,
            max_tokens=8,
        ),
        "json": SamplingParams(
            temperature=0.0, max_tokens=12, grammar=GrammarSpec.json_schema(SCHEMA)
        ),
    }
    requests = [GenerateRequest(name, prompt, p, tenant_id="t") for name, p in params.items()]
    lora = SamplingParams(temperature=0.0, **plain)
    requests.append(
        GenerateRequest("lora", prompt, lora, tenant_id="t", lora_name="a", lora_path=str(adapter))
    )
    return requests


class AuditedRun(NamedTuple):
    engine: LLMEngine
    outputs: dict[str, list[RequestOutput]]
    audit: StepAudit
    generators_made: list[str]  # made by watched code without a device
    num_steps: int


def run_audited(
    make_engine: Callable[[], LLMEngine], requests: list[GenerateRequest]
) -> AuditedRun:
    """Build an engine, add ``requests`` and step until all are done, watched throughout
    (generators from the engine's construction on, tensors from the first request on)."""
    outputs: dict[str, list[RequestOutput]] = {}
    num_steps = 0
    with noted_generators() as made:
        engine = make_engine()
        audit = StepAudit()
        with audit:
            for request in requests:
                engine.add_request(request)
            while engine.has_unfinished and num_steps < 200:
                for output in engine.step():
                    outputs.setdefault(output.request_id, []).append(output)
                num_steps += 1
    assert not engine.has_unfinished
    return AuditedRun(engine, outputs, audit, made, num_steps)


def check_every_path_ran(run: AuditedRun, drafted: bool = True) -> None:
    """No request failed; logprobs came back with their alternatives, the grammar shaped its
    output; with ``drafted``, drafts were verified too (a model that never repeats itself
    proposes none)."""
    outputs = run.outputs
    for name, outs in outputs.items():
        assert outs[-1].error is None, (name, outs[-1].error)
        assert outs[-1].finished and sum(len(o.token_ids) for o in outs) > 0, name
    assert run.engine.stats.num_draft_tokens > 0 or not drafted
    with_tokens = [o for o in outputs["logprobs"] if o.token_ids]
    assert with_tokens and all(o.logprobs and len(o.logprobs[0].top) == 3 for o in with_tokens)
    assert "".join(o.text for o in outputs["json"]).startswith("{")
