"""The engine loop's typed messages: commands in, and the child process's reports out.

One set of commands drives the loop wherever it runs (``engine/engine_loop.py``): on a thread
they cross a queue as they are; to a child process they cross a pipe as msgpack (msgspec), and so
do the child's reports back, each decoded into its own type.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

import msgspec

from engine.outputs import GenerateRequest, RequestOutput
from engine.stats import EngineSnapshot

# -- commands: the caller to the loop -----------------------------------------------------------


class Add(msgspec.Struct, frozen=True, tag=True):
    """Queue a request (its outputs go to the sink the client registered for its id)."""

    request: GenerateRequest


class Abort(msgspec.Struct, frozen=True, tag=True):
    """Stop a request; its pages are freed and its last output comes with the next step."""

    request_id: str


class Drop(msgspec.Struct, frozen=True, tag=True):
    """Free a (suspended or deleted) tenant's unlocked cached pages."""

    tenant_id: str


class Stop(msgspec.Struct, frozen=True, tag=True):
    """Abort what is left, report it, and end the loop."""


Command = Add | Abort | Drop | Stop

# -- reports: the child process to its parent ---------------------------------------------------


class Rejected(msgspec.Struct, frozen=True):
    """A request ``Add`` could not queue, with its error's stable code."""

    request_id: str
    code: str
    message: str
    param: str | None = None


class Ready(msgspec.Struct, frozen=True, tag=True):
    """The model is loaded and the loop takes commands."""

    model_name: str
    max_model_len: int
    snapshot: EngineSnapshot


class Step(msgspec.Struct, frozen=True, tag=True):
    """A step's outputs, the requests refused since the last report, and maybe a snapshot."""

    outputs: list[RequestOutput]
    rejected: list[Rejected]
    snapshot: EngineSnapshot | None = None


class Stopped(msgspec.Struct, frozen=True, tag=True):
    """The loop ended on ``Stop``; nothing follows."""

    snapshot: EngineSnapshot


class Dead(msgspec.Struct, frozen=True, tag=True):
    """The loop died of an internal failure; nothing follows."""

    reason: str


class Failed(msgspec.Struct, frozen=True, tag=True):
    """The engine could not be built (a bad path, a broken file); nothing follows."""

    reason: str


Report = Ready | Step | Stopped | Dead | Failed


class Channel:
    """One end of a one-way pipe that carries typed messages as msgpack."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._encoder = msgspec.msgpack.Encoder()
        self._commands: msgspec.msgpack.Decoder[Command] = msgspec.msgpack.Decoder(Command)
        self._reports: msgspec.msgpack.Decoder[Report] = msgspec.msgpack.Decoder(Report)

    def send(self, message: Command | Report) -> None:
        self.connection.send_bytes(self._encoder.encode(message))

    def poll(self, timeout: float = 0.0) -> bool:
        return self.connection.poll(timeout)

    def recv_command(self) -> Command:
        return self._commands.decode(self.connection.recv_bytes())

    def recv_report(self) -> Report:
        return self._reports.decode(self.connection.recv_bytes())

    def close(self) -> None:
        self.connection.close()
