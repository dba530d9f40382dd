"""One log line per generation request (``request_done``), however it ends: answered, refused
before it reached the engine, ended by the engine, or left by its client.

A ``RequestTrail`` follows the request from its arrival; what is known of it (its tenant, key
and model) is noted on the way, and the first ending writes the line — never a second one.
Prompts, completions and keys are never logged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog

from web.ops.errors import CLIENT_CLOSED

log = structlog.get_logger("atrium.web")
EVENT = "request_done"


@dataclass(slots=True)
class RequestTrail:
    """A generation request from its arrival (monotonic seconds) to its one log line."""

    request_id: str  # the response's x-request-id
    endpoint: str
    arrived: float = field(default_factory=time.monotonic)
    tenant: str | None = None
    key_id: str | None = None
    model: str | None = None
    batch_id: str | None = None
    written: bool = False

    def note(self, *, tenant: str, key_id: str | None, model: str, batch_id: str | None) -> None:
        """Whom the request runs for and the model it names, once they are known."""
        self.tenant, self.key_id, self.model, self.batch_id = tenant, key_id, model, batch_id

    def finished(
        self,
        *,
        status: int,
        outcome: str,
        completion_id: str,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        ttft_s: float | None,
        finish_reason: str | None,
    ) -> None:
        """An admitted request ended: ``outcome`` is its usage status (ok, error, disconnect,
        rejected, unavailable), ``status`` the HTTP status its client got."""
        self._write(
            status=status,
            outcome=outcome,
            reason=None,
            completion_id=completion_id,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            completion_tokens=completion_tokens,
            ttft_s=None if ttft_s is None else round(ttft_s, 6),
            finish_reason=finish_reason,
        )

    def refused(self, status: int, reason: str) -> None:
        """Ended before reaching the engine (``reason``: the limit or the error's code): refused,
        left by its client (499) or failed on our side (a 5xx other than 503)."""
        outcome = "refused"
        if status == CLIENT_CLOSED:
            outcome = "disconnect"
        elif status >= 500 and status != 503:
            outcome = "error"
        self._write(
            status=status,
            outcome=outcome,
            reason=reason,
            completion_id=None,
            prompt_tokens=0,
            cached_tokens=0,
            completion_tokens=0,
            ttft_s=None,
            finish_reason=None,
        )

    def _write(self, *, status: int, **fields: object) -> None:
        if self.written:
            return
        self.written = True
        write = log.warning if status >= 500 else log.info
        write(
            EVENT,
            request_id=self.request_id,
            status=status,
            endpoint=self.endpoint,
            model=self.model,
            tenant_id=self.tenant,
            key_id=self.key_id,
            batch_id=self.batch_id,
            duration_s=round(time.monotonic() - self.arrived, 6),
            **fields,
        )
