from common.protocol import runner_pb2 as _runner_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunnerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUNNER_STATE_UNSPECIFIED: _ClassVar[RunnerState]
    RUNNER_STATE_STOPPED: _ClassVar[RunnerState]
    RUNNER_STATE_STARTING: _ClassVar[RunnerState]
    RUNNER_STATE_SERVING: _ClassVar[RunnerState]
    RUNNER_STATE_DRAINING: _ClassVar[RunnerState]
    RUNNER_STATE_BACKOFF: _ClassVar[RunnerState]
    RUNNER_STATE_FAILED: _ClassVar[RunnerState]
RUNNER_STATE_UNSPECIFIED: RunnerState
RUNNER_STATE_STOPPED: RunnerState
RUNNER_STATE_STARTING: RunnerState
RUNNER_STATE_SERVING: RunnerState
RUNNER_STATE_DRAINING: RunnerState
RUNNER_STATE_BACKOFF: RunnerState
RUNNER_STATE_FAILED: RunnerState

class PullRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class PullProgress(_message.Message):
    __slots__ = ("status", "file", "digest", "total", "completed")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    status: str
    file: str
    digest: str
    total: int
    completed: int
    def __init__(self, status: _Optional[str] = ..., file: _Optional[str] = ..., digest: _Optional[str] = ..., total: _Optional[int] = ..., completed: _Optional[int] = ...) -> None: ...

class PullStatus(_message.Message):
    __slots__ = ("model", "total", "completed", "status")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    model: str
    total: int
    completed: int
    status: str
    def __init__(self, model: _Optional[str] = ..., total: _Optional[int] = ..., completed: _Optional[int] = ..., status: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_ids", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "num_draft_tokens", "request_id", "ignore_eos", "messages", "chat_template_kwargs", "logprobs", "top_logprobs", "drafter", "grammar", "logit_bias", "tools", "tool_choice", "tool_name", "parallel_tool_calls", "presence_penalty", "frequency_penalty", "repetition_penalty", "max_context", "resume_ids", "resume_text", "n", "prompt_logprobs", "context_ids", "return_prompt_ids", "defaulted", "adapter", "think", "reasoning_budget", "reasoning_effort", "model")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    RESUME_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TEXT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    DEFAULTED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    THINK_FIELD_NUMBER: _ClassVar[int]
    REASONING_BUDGET_FIELD_NUMBER: _ClassVar[int]
    REASONING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    num_draft_tokens: int
    request_id: str
    ignore_eos: bool
    messages: _containers.RepeatedCompositeFieldContainer[_runner_pb2.ChatMessage]
    chat_template_kwargs: str
    logprobs: bool
    top_logprobs: int
    drafter: str
    grammar: str
    logit_bias: _containers.ScalarMap[int, float]
    tools: str
    tool_choice: str
    tool_name: str
    parallel_tool_calls: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    max_context: int
    resume_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_text: int
    n: int
    prompt_logprobs: bool
    context_ids: _containers.RepeatedScalarFieldContainer[int]
    return_prompt_ids: bool
    defaulted: _containers.RepeatedScalarFieldContainer[str]
    adapter: str
    think: str
    reasoning_budget: int
    reasoning_effort: str
    model: str
    def __init__(self, prompt: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., num_draft_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., ignore_eos: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[_runner_pb2.ChatMessage, _Mapping]]] = ..., chat_template_kwargs: _Optional[str] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., drafter: _Optional[str] = ..., grammar: _Optional[str] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., tools: _Optional[str] = ..., tool_choice: _Optional[str] = ..., tool_name: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., max_context: _Optional[int] = ..., resume_ids: _Optional[_Iterable[int]] = ..., resume_text: _Optional[int] = ..., n: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., context_ids: _Optional[_Iterable[int]] = ..., return_prompt_ids: _Optional[bool] = ..., defaulted: _Optional[_Iterable[str]] = ..., adapter: _Optional[str] = ..., think: _Optional[str] = ..., reasoning_budget: _Optional[int] = ..., reasoning_effort: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("texts", "token_ids", "truncate", "dimensions", "request_id", "prompt_name", "model")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedCompositeFieldContainer[_runner_pb2.TokenIds]
    truncate: bool
    dimensions: int
    request_id: str
    prompt_name: str
    model: str
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[_Union[_runner_pb2.TokenIds, _Mapping]]] = ..., truncate: _Optional[bool] = ..., dimensions: _Optional[int] = ..., request_id: _Optional[str] = ..., prompt_name: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("query", "documents", "truncate", "request_id", "model")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    query: str
    documents: _containers.RepeatedScalarFieldContainer[str]
    truncate: bool
    request_id: str
    model: str
    def __init__(self, query: _Optional[str] = ..., documents: _Optional[_Iterable[str]] = ..., truncate: _Optional[bool] = ..., request_id: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class MemorySample(_message.Message):
    __slots__ = ("rss", "anonymous", "pss", "uss", "peak_rss", "growth_bytes_per_s", "mlx_active", "mlx_cache", "mlx_peak", "mlx_releases", "soft_limit", "hard_limit", "history_samples", "estimate", "prompt_cache", "queued", "active_requests", "process_rss")
    RSS_FIELD_NUMBER: _ClassVar[int]
    ANONYMOUS_FIELD_NUMBER: _ClassVar[int]
    PSS_FIELD_NUMBER: _ClassVar[int]
    USS_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_FIELD_NUMBER: _ClassVar[int]
    GROWTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    MLX_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    MLX_CACHE_FIELD_NUMBER: _ClassVar[int]
    MLX_PEAK_FIELD_NUMBER: _ClassVar[int]
    MLX_RELEASES_FIELD_NUMBER: _ClassVar[int]
    SOFT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    HARD_LIMIT_FIELD_NUMBER: _ClassVar[int]
    HISTORY_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROCESS_RSS_FIELD_NUMBER: _ClassVar[int]
    rss: int
    anonymous: int
    pss: int
    uss: int
    peak_rss: int
    growth_bytes_per_s: float
    mlx_active: int
    mlx_cache: int
    mlx_peak: int
    mlx_releases: int
    soft_limit: int
    hard_limit: int
    history_samples: int
    estimate: int
    prompt_cache: _runner_pb2.PromptCacheStats
    queued: int
    active_requests: int
    process_rss: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rss: _Optional[int] = ..., anonymous: _Optional[int] = ..., pss: _Optional[int] = ..., uss: _Optional[int] = ..., peak_rss: _Optional[int] = ..., growth_bytes_per_s: _Optional[float] = ..., mlx_active: _Optional[int] = ..., mlx_cache: _Optional[int] = ..., mlx_peak: _Optional[int] = ..., mlx_releases: _Optional[int] = ..., soft_limit: _Optional[int] = ..., hard_limit: _Optional[int] = ..., history_samples: _Optional[int] = ..., estimate: _Optional[int] = ..., prompt_cache: _Optional[_Union[_runner_pb2.PromptCacheStats, _Mapping]] = ..., queued: _Optional[int] = ..., active_requests: _Optional[int] = ..., process_rss: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelStatus(_message.Message):
    __slots__ = ("name", "state", "reason", "pid", "restarts", "last_used_s_ago", "memory", "target", "draft", "in_flight", "generated_tokens", "acceptance_rate", "loading_s", "last_load_s", "embed_requests", "embedded_inputs", "embed_seconds", "making_room_for")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_S_AGO_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    LOADING_S_FIELD_NUMBER: _ClassVar[int]
    LAST_LOAD_S_FIELD_NUMBER: _ClassVar[int]
    EMBED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDED_INPUTS_FIELD_NUMBER: _ClassVar[int]
    EMBED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAKING_ROOM_FOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: RunnerState
    reason: str
    pid: int
    restarts: int
    last_used_s_ago: float
    memory: MemorySample
    target: str
    draft: str
    in_flight: int
    generated_tokens: int
    acceptance_rate: float
    loading_s: float
    last_load_s: float
    embed_requests: int
    embedded_inputs: int
    embed_seconds: float
    making_room_for: str
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[RunnerState, str]] = ..., reason: _Optional[str] = ..., pid: _Optional[int] = ..., restarts: _Optional[int] = ..., last_used_s_ago: _Optional[float] = ..., memory: _Optional[_Union[MemorySample, _Mapping]] = ..., target: _Optional[str] = ..., draft: _Optional[str] = ..., in_flight: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., loading_s: _Optional[float] = ..., last_load_s: _Optional[float] = ..., embed_requests: _Optional[int] = ..., embedded_inputs: _Optional[int] = ..., embed_seconds: _Optional[float] = ..., making_room_for: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetMemoryRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetMemoryResponse(_message.Message):
    __slots__ = ("models", "system_available", "system_total", "supervisor_rss")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SUPERVISOR_RSS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    system_available: int
    system_total: int
    supervisor_rss: int
    def __init__(self, models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ..., system_available: _Optional[int] = ..., system_total: _Optional[int] = ..., supervisor_rss: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("version", "pid", "uptime_s", "ready", "models", "max_loaded", "pulls", "cached")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOADED_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    version: str
    pid: int
    uptime_s: float
    ready: bool
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    max_loaded: int
    pulls: _containers.RepeatedCompositeFieldContainer[PullStatus]
    cached: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[str] = ..., pid: _Optional[int] = ..., uptime_s: _Optional[float] = ..., ready: _Optional[bool] = ..., models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ..., max_loaded: _Optional[int] = ..., pulls: _Optional[_Iterable[_Union[PullStatus, _Mapping]]] = ..., cached: _Optional[_Iterable[str]] = ...) -> None: ...
