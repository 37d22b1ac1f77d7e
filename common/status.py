"""What a client sees when something goes wrong: every error as a gRPC status code.

Every error this system raises on purpose carries its gRPC code (``status_of``);
the gRPC servers of the runner and the supervisor turn it into a status with
one interceptor (``StatusInterceptor``; ``AsyncStatusInterceptor`` on grpc.aio),
and the supervisor's HTTP API turns the same code into an HTTP status in its own shape (``supervisor.http_errors``).
Importable without MLX.
"""

from __future__ import annotations

import inspect
import logging

import grpc
import grpc.aio

from .errors import (
    ClientTooSlow,
    ContextExceeded,
    EngineError,
    InvalidRequest,
    ModelLoadError,
    NotReady,
    QueueFull,
    WorkerStopped,
)

log = logging.getLogger(__name__)

Code = grpc.StatusCode


class ServiceError(Exception):
    """An error with the status the client gets; ``param`` names the request field, when one is at fault."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None, exceeded=None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.exceeded: ContextExceeded | None = exceeded  # a prompt past the context, which each API words its way

    @classmethod
    def from_details(cls, code: grpc.StatusCode, details: str) -> ServiceError:
        """A runner's status about the request, passed on: the field an INVALID_ARGUMENT names ("field: why", when
        it is a field of the request) and whether it is a prompt past the context."""
        if code != Code.INVALID_ARGUMENT:
            return cls(code, details)
        from .protocol import runner_pb2

        field = details.split(":", 1)[0]
        named = field if field in runner_pb2.GenerateRequest.DESCRIPTOR.fields_by_name else None
        return cls(code, details, named, ContextExceeded.parse(details))


def status_of(error: BaseException) -> ServiceError:
    """The ServiceError a raised exception stands for (INTERNAL for anything unexpected)."""
    if isinstance(error, ServiceError):
        return error
    if isinstance(error, InvalidRequest):
        exceeded = error if isinstance(error, ContextExceeded) else None
        return ServiceError(Code.INVALID_ARGUMENT, str(error), error.field, exceeded)
    if isinstance(error, (QueueFull, ClientTooSlow)):
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


def logged_status(error: BaseException) -> ServiceError:
    """``status_of(error)``, with an unexpected error (INTERNAL) logged with its traceback: what both
    interceptors answer."""
    status = status_of(error)
    if status.code == Code.INTERNAL:
        log.error("%s", status.message, exc_info=error)
    return status


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
                self._unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer
            )
        return handler

    @staticmethod
    def _abort(context, error: BaseException):
        """End the call with ``error``'s status; an abort already under way (context.abort raises a bare
        Exception to end the call) goes on as it is."""
        if type(error) is Exception:
            raise error
        status = logged_status(error)
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


class AsyncStatusInterceptor(grpc.aio.ServerInterceptor):
    """``StatusInterceptor`` for a grpc.aio server (the supervisor's front door): the same mapping, for the
    handlers that are coroutines or async generators. Sync handlers (the health service's, run on the server's
    thread pool) pass through untouched."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary and inspect.iscoroutinefunction(handler.unary_unary):
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, method), handler.request_deserializer, handler.response_serializer
            )
        return handler

    @staticmethod
    async def _abort(context, error: BaseException, method: str, request):
        if isinstance(error, grpc.aio.AbortError):  # an abort under way goes on as it is
            raise error
        status = logged_status(error)
        if status.code not in (Code.INTERNAL, Code.CANCELLED):  # a refusal: one line saying who and why
            model = getattr(request, "model", "") or getattr(request, "name", "")
            request_id = getattr(request, "request_id", "") or "-"
            log.info(
                "refused gRPC %s (model %r, request %s): %s %s",
                method,
                model,
                request_id,
                status.code.name,
                status.message,
            )
        await context.abort(status.code, status.message)

    def _unary(self, behavior, method: str):
        async def wrapped(request, context):
            try:
                return await behavior(request, context)
            except Exception as error:  # noqa: BLE001 - every error gets a status
                await self._abort(context, error, method, request)

        return wrapped

    def _stream(self, behavior, method: str):
        async def wrapped(request, context):
            try:
                async for response in behavior(request, context):
                    yield response
            except Exception as error:  # noqa: BLE001 - every error gets a status
                await self._abort(context, error, method, request)

        return wrapped
