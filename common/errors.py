"""Exceptions the engine raises; the gRPC layer maps each to a status code."""

from __future__ import annotations

import re


class EngineError(Exception):
    """Base class for every error the decode engine reports."""


class InvalidRequest(EngineError):
    """A request field is out of range. Maps to INVALID_ARGUMENT."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ContextExceeded(InvalidRequest):
    """The prompt does not fit the context the request may fill: ``tokens`` of it (None: its text is so long that it
    was not tokenized; then ``characters``) against ``context``. Its message has one fixed wording, so the
    supervisor recognises it in a runner's status (``parse``) and each API says it in the words its clients look
    for (OpenAI's ``context_length_exceeded``, Anthropic's "prompt is too long", Ollama's)."""

    PATTERN = re.compile(r"(\d+) (tokens|characters) do not fit the context of (\d+) tokens")

    def __init__(self, field: str, context: int, tokens: int | None = None, characters: int = 0):
        self.context, self.tokens, self.characters = context, tokens, characters
        super().__init__(field, f"{self.amount} do not fit the context of {context} tokens")

    @property
    def amount(self) -> str:
        """How much prompt there is: "9031 tokens", or "40000 characters" where it was not tokenized."""
        return f"{self.tokens} tokens" if self.tokens is not None else f"{self.characters} characters"

    @classmethod
    def parse(cls, text: str) -> ContextExceeded | None:
        """The error a status's details ("field: ...") stand for, or None where they say something else."""
        field, _, message = text.partition(": ")
        match = cls.PATTERN.fullmatch(message)
        if match is None:
            return None
        number, unit, context = int(match.group(1)), match.group(2), int(match.group(3))
        if unit == "tokens":
            return cls(field, context, tokens=number)
        return cls(field, context, characters=number)


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
