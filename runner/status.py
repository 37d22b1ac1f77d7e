"""What a client sees when something goes wrong: one table for gRPC status codes and HTTP statuses.

Every error this system raises on purpose carries its gRPC code (``status_of``);
the gRPC servers of the runner and the supervisor turn it into a status with
one interceptor (``StatusInterceptor``), and the supervisor's OpenAI-compatible
HTTP API turns the same code into an HTTP status and OpenAI's error shape
(``http_status``, ``openai_error``). Importable without MLX.
"""

from __future__ import annotations

import logging

import grpc

from .errors import EngineError, InvalidRequest, ModelLoadError, NotReady, QueueFull, WorkerStopped

log = logging.getLogger(__name__)

Code = grpc.StatusCode

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


class ServiceError(Exception):
    """An error with the status the client gets; ``param`` names the request field, when one is at fault."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def status_of(error: BaseException) -> ServiceError:
    """The ServiceError a raised exception stands for (INTERNAL for anything unexpected)."""
    if isinstance(error, ServiceError):
        return error
    if isinstance(error, InvalidRequest):
        return ServiceError(Code.INVALID_ARGUMENT, str(error), error.field)
    if isinstance(error, QueueFull):
        return ServiceError(Code.RESOURCE_EXHAUSTED, str(error))
    if isinstance(error, (WorkerStopped, NotReady)):
        return ServiceError(Code.UNAVAILABLE, str(error))
    if isinstance(error, ModelLoadError):
        return ServiceError(Code.FAILED_PRECONDITION, str(error))
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return ServiceError(error.code(), error.details() or error.code().name)
    if isinstance(error, EngineError):
        return ServiceError(Code.INTERNAL, f"engine failure: {error}")
    return ServiceError(Code.INTERNAL, f"internal error: {type(error).__name__}: {error}")


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


def openai_error(error: ServiceError) -> tuple[int, dict]:
    """HTTP status and body in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    status = http_status(error.code)
    return status, {"error": {"message": error.message, "type": OPENAI_TYPES.get(status, "server_error"),
                              "param": error.param, "code": error.code.name.lower()}}


class StatusInterceptor(grpc.ServerInterceptor):
    """Turns every exception a handler raises into the gRPC status ``status_of`` gives it.

    Handlers raise; they never call ``context.abort`` for an error of their own.
    Unexpected exceptions are logged with their traceback and answer INTERNAL.
    """

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
        return handler

    @staticmethod
    def _abort(context, error: BaseException):
        """End the call with ``error``'s status; an abort already under way (context.abort raises a bare
        Exception to end the call) goes on as it is."""
        if type(error) is Exception:
            raise error
        status = status_of(error)
        if status.code == Code.INTERNAL:
            log.error("%s", status.message, exc_info=error)
        context.abort(status.code, status.message)

    def _unary(self, behavior):
        def wrapped(request, context):
            try:
                return behavior(request, context)
            except Exception as error:  # noqa: BLE001 - every error gets a status
                self._abort(context, error)

        return wrapped

    def _stream(self, behavior):
        def wrapped(request, context):
            try:
                yield from behavior(request, context)
            except Exception as error:  # noqa: BLE001 - every error gets a status
                self._abort(context, error)

        return wrapped
