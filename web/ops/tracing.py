"""OpenTelemetry for one app: a tracer provider of its own; OTLP export only when configured."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.outputs import StepTrace


def make_tracer_provider(
    otlp_endpoint: str | None, extra_processor: SpanProcessor | None = None
) -> TracerProvider:
    """A provider for this app (the global one stays untouched, so tests do not interfere)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "atrium-gateway"}))
    if otlp_endpoint:
        endpoint = otlp_endpoint.rstrip("/")
        if not endpoint.endswith("/v1/traces"):
            endpoint += "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    if extra_processor is not None:
        provider.add_span_processor(extra_processor)
    return provider


def incoming_context(headers: Mapping[str, str]) -> Context | None:
    """The caller's trace from a W3C ``traceparent`` (and ``tracestate``) header, or None.

    A malformed header is ignored, as the W3C spec asks: the request then starts a trace."""
    if "traceparent" not in headers:
        return None
    carrier = {name: headers[name] for name in ("traceparent", "tracestate") if name in headers}
    context = TraceContextTextMapPropagator().extract(carrier)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


class RequestSpans:
    """The span of one generation and its ``queue`` then ``decode`` children; the generation's
    span is a child of ``parent`` (the caller's ``traceparent``) when there is one."""

    def __init__(
        self,
        tracer: trace.Tracer,
        name: str,
        attributes: dict[str, str | int],
        parent: Context | None = None,
    ) -> None:
        self._tracer = tracer
        self.root = tracer.start_span(name, context=parent, attributes=attributes)
        self._context = trace.set_span_in_context(self.root)
        self._phase: trace.Span | None = tracer.start_span("queue", context=self._context)

    def first_token(self) -> None:
        """Queueing (and prefill) is over; decoding starts."""
        if self._phase is not None:
            self._phase.end()
        self._phase = self._tracer.start_span("decode", context=self._context)

    def steps(self, steps: Iterable[StepTrace]) -> None:
        """A span per engine step the request was in, timed by the engine, under the request's."""
        for step in steps:
            span = self._tracer.start_span(
                f"engine {step.kind}",
                context=self._context,
                start_time=step.start_ns,
                attributes={
                    "atrium.step.tokens": step.num_tokens,
                    "atrium.step.batch_size": step.batch_size,
                    "atrium.step.batch_tokens": step.batch_tokens,
                },
            )
            span.end(end_time=step.end_ns)

    def finish(self, status: str, attributes: dict[str, int]) -> None:
        if self._phase is not None:
            self._phase.end()
            self._phase = None
        self.root.set_attributes({"atrium.status": status, **attributes})
        if status == "error":
            self.root.set_status(trace.StatusCode.ERROR)
        self.root.end()
