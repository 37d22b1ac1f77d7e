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


def openai_error(error: ServiceError) -> tuple[int, dict]:
    """HTTP status and body in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    status = http_status(error.code)
    return status, {
        "error": {
            "message": error.message,
            "type": OPENAI_TYPES.get(status, "server_error"),
            "param": error.param,
            "code": error.code.name.lower(),
        }
    }
