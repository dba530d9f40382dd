"""The one engine loop, driven through its inbox and outbox (as on a thread or in a child):
commands in order, a refused request reported alone, and Stop aborting what is left."""

from __future__ import annotations

from engine.commands import Abort, Add, Command, Drop, Stop
from engine.engine_loop import EngineLoop
from engine.errors import PromptTooLongError
from engine.outputs import GenerateRequest, RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineSnapshot


class ScriptedEngine:
    """Stands in for LLMEngine: a request lives until aborted; "long" ones are refused."""

    def __init__(self) -> None:
        self.live: list[str] = []
        self.pending: list[RequestOutput] = []
        self.log: list[str] = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.live or self.pending)

    def add_request(self, request: GenerateRequest) -> None:
        if request.request_id.startswith("long"):
            raise PromptTooLongError("too long", "messages")
        self.live.append(request.request_id)
        self.log.append(f"add {request.request_id}")

    def abort(self, request_id: str) -> bool:
        self.log.append(f"abort {request_id}")
        if request_id not in self.live:
            return False
        self.live.remove(request_id)
        self.pending.append(RequestOutput(request_id, finished=True, finish_reason="abort"))
        return True

    def abort_all(self) -> int:
        live = list(self.live)
        for request_id in live:
            self.abort(request_id)
        return len(live)

    def drop_tenant(self, tenant_id: str) -> int:
        self.log.append(f"drop {tenant_id}")
        return 0

    def step(self) -> list[RequestOutput]:
        outputs, self.pending = self.pending, []
        return outputs + [RequestOutput(rid, [1]) for rid in self.live]

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot()


class ListInbox:
    def __init__(self, commands: list[Command]) -> None:
        self.commands = commands

    def get(self, timeout: float | None) -> Command | None:
        return self.commands.pop(0) if self.commands else None


class RecordingOutbox:
    def __init__(self) -> None:
        self.rejected: list[tuple[str, Exception]] = []
        self.outputs: list[RequestOutput] = []
        self.snapshots = 0

    def reject(self, request_id: str, exc: Exception) -> None:
        self.rejected.append((request_id, exc))

    def report(self, outputs: list[RequestOutput], snapshot: EngineSnapshot | None) -> None:
        self.outputs += outputs
        self.snapshots += snapshot is not None


def add(request_id: str) -> Add:
    return Add(GenerateRequest(request_id, [1, 2], SamplingParams(max_tokens=4)))


def test_commands_apply_in_order_and_stop_aborts_what_is_left() -> None:
    engine, outbox = ScriptedEngine(), RecordingOutbox()
    commands: list[Command] = [add("a"), add("b"), Abort("a"), Drop("acme"), add("long"), Stop()]
    EngineLoop(engine, ListInbox(commands), outbox).run()  # type: ignore[arg-type]
    assert engine.log == ["add a", "add b", "abort a", "drop acme", "abort b"]
    finished = {o.request_id: o.finish_reason for o in outbox.outputs if o.finished}
    assert finished == {"a": "abort", "b": "abort"}
    assert outbox.outputs[-1].request_id == "b"  # the last report is Stop's aborts
    assert [(rid, type(exc)) for rid, exc in outbox.rejected] == [("long", PromptTooLongError)]
    assert outbox.snapshots >= 2  # idle at start, and the forced one at the end


def test_a_refused_request_leaves_the_others_running() -> None:
    engine, outbox = ScriptedEngine(), RecordingOutbox()
    EngineLoop(engine, ListInbox([add("long1"), add("c"), Stop()]), outbox).run()  # type: ignore[arg-type]
    assert [rid for rid, _ in outbox.rejected] == ["long1"]
    assert [o.finish_reason for o in outbox.outputs if o.request_id == "c"][-1] == "abort"
