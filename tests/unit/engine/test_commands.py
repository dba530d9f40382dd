"""Typed messages across the engine's process boundary: every command and report comes out of
the pipe as the type that went in, with nested requests, outputs and snapshots intact."""

from __future__ import annotations

import multiprocessing

import msgspec
import pytest

from engine.commands import (
    Abort,
    Add,
    Channel,
    Dead,
    Drop,
    Failed,
    Ready,
    Rejected,
    Step,
    Stop,
    Stopped,
)
from engine.outputs import GenerateRequest, RequestOutput, StepTrace, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.stats import EngineSnapshot, EngineStats
from engine.structured.spec import GrammarSpec
from radix_cache.stats import NamespaceSnapshot

REQUEST = GenerateRequest(
    "r1",
    [1, 2, 3],
    SamplingParams(
        max_tokens=4,
        stop=("\n",),
        logit_bias=((7, -2.5),),
        grammar=GrammarSpec.json_schema({"type": "object"}),
    ),
    tenant_id="acme",
    tenant_weight=2.0,
    kv_cache_share=0.25,
    num_following=3,
    lora_name="sql",
)
OUTPUT = RequestOutput(
    "r1",
    [5, 6],
    "hi",
    finished=True,
    finish_reason="stop",
    num_prompt_tokens=3,
    num_output_tokens=2,
    logprobs=[TokenLogprob(5, -0.25, ((5, -0.25), (9, -1.5)))],
    steps=[StepTrace("decode", 10, 20, 1, 2, 2)],
)
SNAPSHOT = EngineSnapshot(
    running_by_tenant={"acme": 1},
    num_pages_total=32,
    page_size=16,
    counters=EngineStats(num_steps=7, forward_s=0.5),
    cache_by_namespace={
        "tenant:acme": NamespaceSnapshot("tenant:acme", 2, 1, 0.25, 2.0, 8, 3, 40, 32, 0, 1)
    },
)


def pipe() -> tuple[Channel, Channel]:
    receive, send = multiprocessing.Pipe(duplex=False)
    return Channel(send), Channel(receive)


@pytest.mark.parametrize(
    "command", [Add(REQUEST), Abort("r1"), Drop("acme"), Stop()], ids=lambda c: type(c).__name__
)
def test_commands_cross_the_pipe_as_their_own_type(command: object) -> None:
    send, receive = pipe()
    send.send(command)  # type: ignore[arg-type]
    got = receive.recv_command()
    assert type(got) is type(command)
    assert got == command


@pytest.mark.parametrize(
    "report",
    [
        Ready("tiny", 256, SNAPSHOT),
        Step([OUTPUT], [Rejected("r2", "context_length_exceeded", "too long", "messages")]),
        Step([], [], SNAPSHOT),
        Stopped(SNAPSHOT),
        Dead("RuntimeError('boom')"),
        Failed("FileNotFoundError: missing"),
    ],
    ids=lambda r: type(r).__name__,
)
def test_reports_cross_the_pipe_with_nested_types_intact(report: object) -> None:
    send, receive = pipe()
    send.send(report)  # type: ignore[arg-type]
    got = receive.recv_report()
    assert got == report
    if isinstance(got, Step) and got.outputs:
        assert isinstance(got.outputs[0].logprobs[0], TokenLogprob)  # type: ignore[index]
        assert isinstance(got.outputs[0].steps[0], StepTrace)  # type: ignore[index]
    if isinstance(got, Ready):
        assert isinstance(got.snapshot.cache_by_namespace["tenant:acme"], NamespaceSnapshot)


def test_a_report_is_not_taken_for_a_command() -> None:
    send, receive = pipe()
    send.send(Stopped(SNAPSHOT))
    with pytest.raises(msgspec.ValidationError):
        receive.recv_command()
