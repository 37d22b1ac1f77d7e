from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning", "images")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    reasoning: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., reasoning: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_ids", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "num_draft_tokens", "request_id", "ignore_eos", "messages", "chat_template_kwargs", "logprobs", "top_logprobs", "drafter", "grammar", "logit_bias", "tools", "tool_choice", "tool_name", "parallel_tool_calls", "presence_penalty", "frequency_penalty", "repetition_penalty", "max_context", "resume_ids", "resume_text", "n", "prompt_logprobs", "context_ids", "return_prompt_ids", "adapter", "think", "reasoning_budget", "reasoning_effort")
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
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    THINK_FIELD_NUMBER: _ClassVar[int]
    REASONING_BUDGET_FIELD_NUMBER: _ClassVar[int]
    REASONING_EFFORT_FIELD_NUMBER: _ClassVar[int]
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
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
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
    adapter: str
    think: str
    reasoning_budget: int
    reasoning_effort: str
    def __init__(self, prompt: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., num_draft_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., ignore_eos: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., chat_template_kwargs: _Optional[str] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., drafter: _Optional[str] = ..., grammar: _Optional[str] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., tools: _Optional[str] = ..., tool_choice: _Optional[str] = ..., tool_name: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., max_context: _Optional[int] = ..., resume_ids: _Optional[_Iterable[int]] = ..., resume_text: _Optional[int] = ..., n: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., context_ids: _Optional[_Iterable[int]] = ..., return_prompt_ids: _Optional[bool] = ..., adapter: _Optional[str] = ..., think: _Optional[str] = ..., reasoning_budget: _Optional[int] = ..., reasoning_effort: _Optional[str] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "rounds", "drafted", "accepted", "acceptance_rate", "tokens_per_round", "time_to_first_token_s", "prefill_s", "decode_s", "tokens_per_second", "releases", "release_positions", "active_memory", "cache_memory", "peak_memory", "prefill_chunks", "cached_tokens", "drafter", "depths", "forced", "reasoning_tokens")
    class DepthsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CACHE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    rounds: int
    drafted: int
    accepted: int
    acceptance_rate: float
    tokens_per_round: float
    time_to_first_token_s: float
    prefill_s: float
    decode_s: float
    tokens_per_second: float
    releases: int
    release_positions: _containers.RepeatedScalarFieldContainer[int]
    active_memory: int
    cache_memory: int
    peak_memory: int
    prefill_chunks: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: int
    drafter: str
    depths: _containers.ScalarMap[int, int]
    forced: int
    reasoning_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., tokens_per_round: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., releases: _Optional[int] = ..., release_positions: _Optional[_Iterable[int]] = ..., active_memory: _Optional[int] = ..., cache_memory: _Optional[int] = ..., peak_memory: _Optional[int] = ..., prefill_chunks: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[int] = ..., drafter: _Optional[str] = ..., depths: _Optional[_Mapping[int, int]] = ..., forced: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "drafted", "accepted", "finish_reason", "stats", "logprobs", "tool_calls", "stop_sequence", "prompt_tokens", "choice", "prompt_logprobs", "prompt_ids", "reasoning")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    drafted: int
    accepted: int
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    stop_sequence: str
    prompt_tokens: int
    choice: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    reasoning: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ..., stop_sequence: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., choice: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., reasoning: _Optional[str] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("texts", "token_ids", "truncate", "dimensions", "request_id", "prompt_name")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    truncate: bool
    dimensions: int
    request_id: str
    prompt_name: str
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., truncate: _Optional[bool] = ..., dimensions: _Optional[int] = ..., request_id: _Optional[str] = ..., prompt_name: _Optional[str] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "tokens")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    tokens: int
    def __init__(self, values: _Optional[_Iterable[float]] = ..., tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "prompt_tokens", "truncated")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    prompt_tokens: int
    truncated: int
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ..., truncated: _Optional[int] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("query", "documents", "truncate", "request_id")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    query: str
    documents: _containers.RepeatedScalarFieldContainer[str]
    truncate: bool
    request_id: str
    def __init__(self, query: _Optional[str] = ..., documents: _Optional[_Iterable[str]] = ..., truncate: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("scores", "prompt_tokens", "truncated")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    prompt_tokens: int
    truncated: int
    def __init__(self, scores: _Optional[_Iterable[float]] = ..., prompt_tokens: _Optional[int] = ..., truncated: _Optional[int] = ...) -> None: ...

class CountTokensResponse(_message.Message):
    __slots__ = ("prompt_tokens",)
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("path", "architecture", "parameters", "context_length", "dtype", "vocab_size", "quantization_bits", "quantization_group_size", "cache", "rewindable", "row_padded_layers", "sliding_window", "sliding_layers", "row_padding", "fusion")
    PATH_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_BITS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    REWINDABLE_FIELD_NUMBER: _ClassVar[int]
    ROW_PADDED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SLIDING_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ROW_PADDING_FIELD_NUMBER: _ClassVar[int]
    FUSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    architecture: str
    parameters: int
    context_length: int
    dtype: str
    vocab_size: int
    quantization_bits: int
    quantization_group_size: int
    cache: str
    rewindable: bool
    row_padded_layers: int
    sliding_window: int
    sliding_layers: int
    row_padding: str
    fusion: str
    def __init__(self, path: _Optional[str] = ..., architecture: _Optional[str] = ..., parameters: _Optional[int] = ..., context_length: _Optional[int] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., quantization_bits: _Optional[int] = ..., quantization_group_size: _Optional[int] = ..., cache: _Optional[str] = ..., rewindable: _Optional[bool] = ..., row_padded_layers: _Optional[int] = ..., sliding_window: _Optional[int] = ..., sliding_layers: _Optional[int] = ..., row_padding: _Optional[str] = ..., fusion: _Optional[str] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("name", "target", "draft", "device", "num_draft_tokens", "release_interval", "release_enabled", "cache_limit", "version", "pid", "max_queue", "speculative", "decoding", "dtype_reason", "runtime_rss", "prompt_cache_budget", "drafter", "adaptive_depth", "max_draft_tokens", "max_batch", "batch_memory", "backend", "device_detail", "device_memory", "tool_format", "chat_template", "kv_bits", "kv_group_size", "quantized_kv_start", "ranks", "rank_pids", "rank_memory", "parallelism", "group_backend", "max_output_tokens", "reasoning_format", "vision", "kind", "embedding_dimensions", "matryoshka_dimensions", "pooling", "normalized")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    RELEASE_ENABLED_FIELD_NUMBER: _ClassVar[int]
    CACHE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    DECODING_FIELD_NUMBER: _ClassVar[int]
    DTYPE_REASON_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_RSS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_MEMORY_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    TOOL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZED_KV_START_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    RANK_PIDS_FIELD_NUMBER: _ClassVar[int]
    RANK_MEMORY_FIELD_NUMBER: _ClassVar[int]
    PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    GROUP_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FORMAT_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    NORMALIZED_FIELD_NUMBER: _ClassVar[int]
    name: str
    target: ModelInfo
    draft: ModelInfo
    device: str
    num_draft_tokens: int
    release_interval: int
    release_enabled: bool
    cache_limit: int
    version: str
    pid: int
    max_queue: int
    speculative: bool
    decoding: str
    dtype_reason: str
    runtime_rss: int
    prompt_cache_budget: int
    drafter: str
    adaptive_depth: bool
    max_draft_tokens: int
    max_batch: int
    batch_memory: int
    backend: str
    device_detail: str
    device_memory: int
    tool_format: str
    chat_template: bool
    kv_bits: int
    kv_group_size: int
    quantized_kv_start: int
    ranks: int
    rank_pids: _containers.RepeatedScalarFieldContainer[int]
    rank_memory: _containers.RepeatedScalarFieldContainer[int]
    parallelism: str
    group_backend: str
    max_output_tokens: int
    reasoning_format: str
    vision: bool
    kind: str
    embedding_dimensions: int
    matryoshka_dimensions: _containers.RepeatedScalarFieldContainer[int]
    pooling: str
    normalized: bool
    def __init__(self, name: _Optional[str] = ..., target: _Optional[_Union[ModelInfo, _Mapping]] = ..., draft: _Optional[_Union[ModelInfo, _Mapping]] = ..., device: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., release_interval: _Optional[int] = ..., release_enabled: _Optional[bool] = ..., cache_limit: _Optional[int] = ..., version: _Optional[str] = ..., pid: _Optional[int] = ..., max_queue: _Optional[int] = ..., speculative: _Optional[bool] = ..., decoding: _Optional[str] = ..., dtype_reason: _Optional[str] = ..., runtime_rss: _Optional[int] = ..., prompt_cache_budget: _Optional[int] = ..., drafter: _Optional[str] = ..., adaptive_depth: _Optional[bool] = ..., max_draft_tokens: _Optional[int] = ..., max_batch: _Optional[int] = ..., batch_memory: _Optional[int] = ..., backend: _Optional[str] = ..., device_detail: _Optional[str] = ..., device_memory: _Optional[int] = ..., tool_format: _Optional[str] = ..., chat_template: _Optional[bool] = ..., kv_bits: _Optional[int] = ..., kv_group_size: _Optional[int] = ..., quantized_kv_start: _Optional[int] = ..., ranks: _Optional[int] = ..., rank_pids: _Optional[_Iterable[int]] = ..., rank_memory: _Optional[_Iterable[int]] = ..., parallelism: _Optional[str] = ..., group_backend: _Optional[str] = ..., max_output_tokens: _Optional[int] = ..., reasoning_format: _Optional[str] = ..., vision: _Optional[bool] = ..., kind: _Optional[str] = ..., embedding_dimensions: _Optional[int] = ..., matryoshka_dimensions: _Optional[_Iterable[int]] = ..., pooling: _Optional[str] = ..., normalized: _Optional[bool] = ...) -> None: ...

class MemoryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemoryResponse(_message.Message):
    __slots__ = ("active", "cache", "peak", "cache_limit", "memory_limit", "releases", "rss", "queued", "busy", "peak_rss", "prompt_cache", "active_requests")
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    PEAK_FIELD_NUMBER: _ClassVar[int]
    CACHE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    RSS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    active: int
    cache: int
    peak: int
    cache_limit: int
    memory_limit: int
    releases: int
    rss: int
    queued: int
    busy: bool
    peak_rss: int
    prompt_cache: PromptCacheStats
    active_requests: int
    def __init__(self, active: _Optional[int] = ..., cache: _Optional[int] = ..., peak: _Optional[int] = ..., cache_limit: _Optional[int] = ..., memory_limit: _Optional[int] = ..., releases: _Optional[int] = ..., rss: _Optional[int] = ..., queued: _Optional[int] = ..., busy: _Optional[bool] = ..., peak_rss: _Optional[int] = ..., prompt_cache: _Optional[_Union[PromptCacheStats, _Mapping]] = ..., active_requests: _Optional[int] = ...) -> None: ...

class PromptCacheStats(_message.Message):
    __slots__ = ("budget", "bytes", "entries", "hits", "misses", "reused_tokens", "evictions", "disk_budget", "disk_bytes", "disk_entries", "disk_hits", "disk_failures", "disk_writes", "disk_write_s", "disk_read_s", "cold_entries", "cold_bytes", "cold_hits")
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DISK_BUDGET_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DISK_HITS_FIELD_NUMBER: _ClassVar[int]
    DISK_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITES_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITE_S_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_S_FIELD_NUMBER: _ClassVar[int]
    COLD_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    COLD_BYTES_FIELD_NUMBER: _ClassVar[int]
    COLD_HITS_FIELD_NUMBER: _ClassVar[int]
    budget: int
    bytes: int
    entries: int
    hits: int
    misses: int
    reused_tokens: int
    evictions: int
    disk_budget: int
    disk_bytes: int
    disk_entries: int
    disk_hits: int
    disk_failures: int
    disk_writes: int
    disk_write_s: float
    disk_read_s: float
    cold_entries: int
    cold_bytes: int
    cold_hits: int
    def __init__(self, budget: _Optional[int] = ..., bytes: _Optional[int] = ..., entries: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., evictions: _Optional[int] = ..., disk_budget: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., disk_entries: _Optional[int] = ..., disk_hits: _Optional[int] = ..., disk_failures: _Optional[int] = ..., disk_writes: _Optional[int] = ..., disk_write_s: _Optional[float] = ..., disk_read_s: _Optional[float] = ..., cold_entries: _Optional[int] = ..., cold_bytes: _Optional[int] = ..., cold_hits: _Optional[int] = ...) -> None: ...

class ReleaseMemoryRequest(_message.Message):
    __slots__ = ("prompt_cache",)
    PROMPT_CACHE_FIELD_NUMBER: _ClassVar[int]
    prompt_cache: bool
    def __init__(self, prompt_cache: _Optional[bool] = ...) -> None: ...

class ReleaseMemoryResponse(_message.Message):
    __slots__ = ("cache_before", "cache_after", "evicted_entries", "evicted_bytes", "cooled_entries", "cooled_bytes")
    CACHE_BEFORE_FIELD_NUMBER: _ClassVar[int]
    CACHE_AFTER_FIELD_NUMBER: _ClassVar[int]
    EVICTED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COOLED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    COOLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    cache_before: int
    cache_after: int
    evicted_entries: int
    evicted_bytes: int
    cooled_entries: int
    cooled_bytes: int
    def __init__(self, cache_before: _Optional[int] = ..., cache_after: _Optional[int] = ..., evicted_entries: _Optional[int] = ..., evicted_bytes: _Optional[int] = ..., cooled_entries: _Optional[int] = ..., cooled_bytes: _Optional[int] = ...) -> None: ...

class DebugBlockRequest(_message.Message):
    __slots__ = ("seconds",)
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    def __init__(self, seconds: _Optional[float] = ...) -> None: ...

class DebugBlockResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DebugExitRequest(_message.Message):
    __slots__ = ("code",)
    CODE_FIELD_NUMBER: _ClassVar[int]
    code: int
    def __init__(self, code: _Optional[int] = ...) -> None: ...

class DebugExitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
