"""OpenTelemetry for one app: a tracer provider of its own; OTLP export only when configured."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor


def make_tracer_provider(
    otlp_endpoint: str | None, extra_processor: SpanProcessor | None = None
) -> TracerProvider:
    """A provider for this app (the global one stays untouched, so tests do not interfere)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "atrium-gateway"}))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = otlp_endpoint.rstrip("/")
        if not endpoint.endswith("/v1/traces"):
            endpoint += "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    if extra_processor is not None:
        provider.add_span_processor(extra_processor)
    return provider


class RequestSpans:
    """The span of one generation and its ``queue`` then ``decode`` children."""

    def __init__(self, tracer: trace.Tracer, name: str, attributes: dict[str, str | int]) -> None:
        self._tracer = tracer
        self.root = tracer.start_span(name, attributes=attributes)
        self._context = trace.set_span_in_context(self.root)
        self._phase: trace.Span | None = tracer.start_span("queue", context=self._context)

    def first_token(self) -> None:
        """Queueing (and prefill) is over; decoding starts."""
        if self._phase is not None:
            self._phase.end()
        self._phase = self._tracer.start_span("decode", context=self._context)

    def finish(self, status: str, attributes: dict[str, int]) -> None:
        if self._phase is not None:
            self._phase.end()
            self._phase = None
        self.root.set_attributes({"atrium.status": status, **attributes})
        if status == "error":
            self.root.set_status(trace.StatusCode.ERROR)
        self.root.end()
