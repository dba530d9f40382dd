"""Engine errors: each has a stable ``code`` that the gateway maps to an HTTP status."""

from atrium_errors import AtriumError


class EngineError(AtriumError):
    """Base of the engine's errors."""

    code = "engine_error"


class InvalidRequestError(EngineError):
    """The request itself is wrong (empty prompt, bad sampling values, too long)."""

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) does not fit the model's context or the KV cache."""

    code = "context_length_exceeded"


class EngineOverloadedError(EngineError):
    """The engine cannot take more work now (queue full or shutting down)."""

    code = "overloaded"


class EngineDeadError(EngineError):
    """The engine loop stopped after an internal failure; no request can be served."""

    code = "engine_dead"
