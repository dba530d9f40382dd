"""Starting an engine the gateway can talk to: in a child process (the default) or on a thread."""

from __future__ import annotations

from dataclasses import dataclass

from engine.async_engine import AsyncEngine, EngineClient
from engine.factory import EngineSpec, build_engine
from engine.load_progress import LoadProgress
from engine.model.loader import load_tokenizer
from engine.process_engine import ProcessEngine
from engine.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class RunningEngine:
    client: EngineClient  # started: it takes requests
    tokenizer: Tokenizer
    name: str  # the served model name
    max_model_len: int


def start_engine(
    spec: EngineSpec, *, in_process: bool = False, progress: LoadProgress | None = None
) -> RunningEngine:
    """Build and start the engine ``spec`` names; blocks until it takes requests.

    In a child process (``in_process`` False) the model's kernels never wait for this process's
    GIL and only the tokenizer loads here; on a thread of this process ``progress`` is told the
    load's stages. Raises EngineError (child) or ValueError/FileNotFoundError (bad model).
    """
    if not in_process:
        tokenizer, _ = load_tokenizer(spec.model)
        child = ProcessEngine(spec, tokenizer)
        child.start()
        return RunningEngine(child, tokenizer, child.model_name, child.max_model_len)
    built = build_engine(spec, progress)
    thread = AsyncEngine(built.engine)
    thread.start()
    return RunningEngine(thread, built.engine.tokenizer, built.name, built.engine.max_model_len)
