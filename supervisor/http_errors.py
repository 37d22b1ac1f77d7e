"""The HTTP side of an error: a gRPC status code (``common.status``) as an HTTP status and OpenAI's error body.

Only the HTTP API speaks HTTP, so this table lives beside it, not in the layer both processes share.
"""

from __future__ import annotations

import grpc

from common.status import Code, ServiceError

HTTP_STATUS = {
    Code.OK: 200,
    Code.INVALID_ARGUMENT: 400,
    Code.OUT_OF_RANGE: 400,
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.NOT_FOUND: 404,
    Code.ALREADY_EXISTS: 409,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.CANCELLED: 499,  # the client closed the request
    Code.INTERNAL: 500,
    Code.UNKNOWN: 500,
    Code.DATA_LOSS: 500,
    Code.UNIMPLEMENTED: 501,
    Code.FAILED_PRECONDITION: 503,  # the model failed and will not come back by itself
    Code.UNAVAILABLE: 503,  # the model is starting, restarting or shutting down
    Code.ABORTED: 503,
    Code.DEADLINE_EXCEEDED: 504,
}
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "server_error",
    501: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


def in_api_words(error: ServiceError, names: dict[str, tuple[str, str]]) -> ServiceError:
    """``error`` naming the API's own field where the runner named its internal one: ``names`` maps an internal
    field to (the API's param, the words its message starts with): Anthropic's ``thinking`` for ``think``."""
    if error.param not in names or error.exceeded is not None:
        return error
    param, words = names[error.param]
    message = error.message
    if message.startswith(f"{error.param}:"):
        message = words + message[len(error.param) :]
    return ServiceError(error.code, message, param)


# The Responses API's words for the internal fields: its reasoning object, its input (the internal messages).
RESPONSES_NAMES = {"reasoning_effort": ("reasoning", "reasoning.effort"), "messages": ("input", "input")}


def openai_error(error: ServiceError, prompt_field: str | None = None) -> tuple[int, dict]:
    """HTTP status and body in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}. A prompt past
    the context is said as OpenAI says it (``code: "context_length_exceeded"``, "This model's maximum context
    length is ...", which LiteLLM and the agent frameworks recognise), naming ``prompt_field`` (the field of the
    request that held the prompt: ``messages``, ``prompt``, ``input``) where given."""
    status = http_status(error.code)
    if prompt_field == "input":  # the Responses API
        error = in_api_words(error, RESPONSES_NAMES)
    message, param, code = error.message, error.param, error.code.name.lower()
    exceeded = error.exceeded
    if exceeded is not None:
        param = prompt_field or exceeded.field
        words = param if param in ("messages", "input") else "prompt"
        amount = (
            f"{exceeded.tokens} tokens"
            if exceeded.tokens is not None
            else (f"more than {exceeded.context} tokens ({exceeded.characters} characters)")
        )
        message = (
            f"This model's maximum context length is {exceeded.context} tokens. However, your {words} resulted in "
            f"{amount}. Please reduce the length of the {words}."
        )
        code = "context_length_exceeded"
    return status, {
        "error": {"message": message, "type": OPENAI_TYPES.get(status, "server_error"), "param": param, "code": code}
    }
