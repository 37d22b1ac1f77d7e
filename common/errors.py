"""Exceptions the engine raises; the gRPC layer maps each to a status code."""


class EngineError(Exception):
    """Base class for every error the decode engine reports."""


class InvalidRequest(EngineError):
    """A request field is out of range. Maps to INVALID_ARGUMENT."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelLoadError(EngineError):
    """A model folder is missing, unreadable or inconsistent."""

    def __init__(self, folder, cause: str):
        super().__init__(f"cannot load model from {folder}: {cause}")
        self.folder = str(folder)
        self.cause = cause


class TokenizerMismatch(ModelLoadError):
    """The draft model does not share the target's vocabulary."""


class QueueFull(EngineError):
    """No room for another waiting request. Maps to RESOURCE_EXHAUSTED."""


class ClientTooSlow(EngineError):
    """A request's client read its answer so slowly that too many rounds waited for it: the request was stopped
    to bound the memory it held. Maps to RESOURCE_EXHAUSTED."""


class WorkerStopped(EngineError):
    """The runner is shutting down and takes no more work. Maps to UNAVAILABLE."""


class NotReady(EngineError):
    """The models are still loading. Maps to UNAVAILABLE."""
