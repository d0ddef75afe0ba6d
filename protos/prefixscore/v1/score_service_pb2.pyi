from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Activation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTIVATION_UNSPECIFIED: _ClassVar[Activation]
    ACTIVATION_NONE: _ClassVar[Activation]
    ACTIVATION_SIGMOID: _ClassVar[Activation]
    ACTIVATION_SOFTMAX: _ClassVar[Activation]

class Truncate(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRUNCATE_UNSPECIFIED: _ClassVar[Truncate]
    TRUNCATE_NONE: _ClassVar[Truncate]
    TRUNCATE_END: _ClassVar[Truncate]

class TruncationSide(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRUNCATION_SIDE_UNSPECIFIED: _ClassVar[TruncationSide]
    TRUNCATION_SIDE_LEFT: _ClassVar[TruncationSide]
    TRUNCATION_SIDE_RIGHT: _ClassVar[TruncationSide]

class QueryTruncation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    QUERY_TRUNCATION_UNSPECIFIED: _ClassVar[QueryTruncation]
    QUERY_TRUNCATION_NONE: _ClassVar[QueryTruncation]
    QUERY_TRUNCATION_LEFT: _ClassVar[QueryTruncation]
    QUERY_TRUNCATION_RIGHT: _ClassVar[QueryTruncation]
ACTIVATION_UNSPECIFIED: Activation
ACTIVATION_NONE: Activation
ACTIVATION_SIGMOID: Activation
ACTIVATION_SOFTMAX: Activation
TRUNCATE_UNSPECIFIED: Truncate
TRUNCATE_NONE: Truncate
TRUNCATE_END: Truncate
TRUNCATION_SIDE_UNSPECIFIED: TruncationSide
TRUNCATION_SIDE_LEFT: TruncationSide
TRUNCATION_SIDE_RIGHT: TruncationSide
QUERY_TRUNCATION_UNSPECIFIED: QueryTruncation
QUERY_TRUNCATION_NONE: QueryTruncation
QUERY_TRUNCATION_LEFT: QueryTruncation
QUERY_TRUNCATION_RIGHT: QueryTruncation

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Input(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("query", "items", "label_token_ids", "labels", "apply_softmax", "item_first", "truncate", "query_truncation", "max_query_tokens", "check_tokenization", "activation", "messages", "truncation_side", "loglikelihood", "top_logprobs")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    LABEL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    APPLY_SOFTMAX_FIELD_NUMBER: _ClassVar[int]
    ITEM_FIRST_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    QUERY_TRUNCATION_FIELD_NUMBER: _ClassVar[int]
    MAX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECK_TOKENIZATION_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_SIDE_FIELD_NUMBER: _ClassVar[int]
    LOGLIKELIHOOD_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    query: Input
    items: _containers.RepeatedCompositeFieldContainer[Input]
    label_token_ids: _containers.RepeatedScalarFieldContainer[int]
    labels: _containers.RepeatedScalarFieldContainer[str]
    apply_softmax: bool
    item_first: bool
    truncate: Truncate
    query_truncation: QueryTruncation
    max_query_tokens: int
    check_tokenization: bool
    activation: Activation
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    truncation_side: TruncationSide
    loglikelihood: bool
    top_logprobs: int
    def __init__(self, query: _Optional[_Union[Input, _Mapping]] = ..., items: _Optional[_Iterable[_Union[Input, _Mapping]]] = ..., label_token_ids: _Optional[_Iterable[int]] = ..., labels: _Optional[_Iterable[str]] = ..., apply_softmax: _Optional[bool] = ..., item_first: _Optional[bool] = ..., truncate: _Optional[_Union[Truncate, str]] = ..., query_truncation: _Optional[_Union[QueryTruncation, str]] = ..., max_query_tokens: _Optional[int] = ..., check_tokenization: _Optional[bool] = ..., activation: _Optional[_Union[Activation, str]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., truncation_side: _Optional[_Union[TruncationSide, str]] = ..., loglikelihood: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ItemScores(_message.Message):
    __slots__ = ("probabilities", "likelihood")
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    LIKELIHOOD_FIELD_NUMBER: _ClassVar[int]
    probabilities: _containers.RepeatedScalarFieldContainer[float]
    likelihood: ItemLikelihood
    def __init__(self, probabilities: _Optional[_Iterable[float]] = ..., likelihood: _Optional[_Union[ItemLikelihood, _Mapping]] = ...) -> None: ...

class ItemLikelihood(_message.Message):
    __slots__ = ("logprob", "is_greedy", "token_logprobs", "greedy", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    IS_GREEDY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    is_greedy: bool
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    greedy: _containers.RepeatedScalarFieldContainer[bool]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, logprob: _Optional[float] = ..., is_greedy: _Optional[bool] = ..., token_logprobs: _Optional[_Iterable[float]] = ..., greedy: _Optional[_Iterable[bool]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "items", "truncated_query_tokens", "truncated_items", "truncated_item_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_ITEM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    items: int
    truncated_query_tokens: int
    truncated_items: _containers.RepeatedScalarFieldContainer[int]
    truncated_item_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., items: _Optional[int] = ..., truncated_query_tokens: _Optional[int] = ..., truncated_items: _Optional[_Iterable[int]] = ..., truncated_item_tokens: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores", "usage", "label_token_ids", "joined_tokenization_differs", "label_names")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LABEL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    JOINED_TOKENIZATION_DIFFERS_FIELD_NUMBER: _ClassVar[int]
    LABEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[ItemScores]
    usage: Usage
    label_token_ids: _containers.RepeatedScalarFieldContainer[int]
    joined_tokenization_differs: _containers.RepeatedScalarFieldContainer[bool]
    label_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, scores: _Optional[_Iterable[_Union[ItemScores, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., label_token_ids: _Optional[_Iterable[int]] = ..., joined_tokenization_differs: _Optional[_Iterable[bool]] = ..., label_names: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamOpen(_message.Message):
    __slots__ = ("query", "label_token_ids", "labels", "apply_softmax", "item_first", "activation", "loglikelihood", "top_logprobs")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    LABEL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    APPLY_SOFTMAX_FIELD_NUMBER: _ClassVar[int]
    ITEM_FIRST_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    LOGLIKELIHOOD_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    query: Input
    label_token_ids: _containers.RepeatedScalarFieldContainer[int]
    labels: _containers.RepeatedScalarFieldContainer[str]
    apply_softmax: bool
    item_first: bool
    activation: Activation
    loglikelihood: bool
    top_logprobs: int
    def __init__(self, query: _Optional[_Union[Input, _Mapping]] = ..., label_token_ids: _Optional[_Iterable[int]] = ..., labels: _Optional[_Iterable[str]] = ..., apply_softmax: _Optional[bool] = ..., item_first: _Optional[bool] = ..., activation: _Optional[_Union[Activation, str]] = ..., loglikelihood: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class ItemBatch(_message.Message):
    __slots__ = ("batch_id", "items")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    items: _containers.RepeatedCompositeFieldContainer[Input]
    def __init__(self, batch_id: _Optional[int] = ..., items: _Optional[_Iterable[_Union[Input, _Mapping]]] = ...) -> None: ...

class ScoreStreamRequest(_message.Message):
    __slots__ = ("open", "batch")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    open: StreamOpen
    batch: ItemBatch
    def __init__(self, open: _Optional[_Union[StreamOpen, _Mapping]] = ..., batch: _Optional[_Union[ItemBatch, _Mapping]] = ...) -> None: ...

class StreamOpened(_message.Message):
    __slots__ = ("prefix_tokens", "cached_tokens", "label_token_ids")
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LABEL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    prefix_tokens: int
    cached_tokens: int
    label_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prefix_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., label_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchScores(_message.Message):
    __slots__ = ("batch_id", "scores")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    scores: _containers.RepeatedCompositeFieldContainer[ItemScores]
    def __init__(self, batch_id: _Optional[int] = ..., scores: _Optional[_Iterable[_Union[ItemScores, _Mapping]]] = ...) -> None: ...

class BatchRefused(_message.Message):
    __slots__ = ("batch_id", "code", "message", "retry_after_ms")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    code: int
    message: str
    retry_after_ms: int
    def __init__(self, batch_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class ScoreStreamResponse(_message.Message):
    __slots__ = ("opened", "batch", "usage", "refused")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    opened: StreamOpened
    batch: BatchScores
    usage: Usage
    refused: BatchRefused
    def __init__(self, opened: _Optional[_Union[StreamOpened, _Mapping]] = ..., batch: _Optional[_Union[BatchScores, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., refused: _Optional[_Union[BatchRefused, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_items", "max_labels", "max_text_chars", "max_queue_items", "max_sequence_tokens", "max_item_tokens", "max_queue_tokens", "max_request_tokens", "max_streams", "max_concurrent_rpcs", "stream_idle_timeout_ms", "max_pending_batches", "keepalive_time_ms", "keepalive_timeout_ms", "max_connection_idle_ms", "max_connection_age_ms", "max_connection_age_grace_ms", "max_message_bytes", "pool_bytes")
    MAX_ITEMS_FIELD_NUMBER: _ClassVar[int]
    MAX_LABELS_FIELD_NUMBER: _ClassVar[int]
    MAX_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_ITEMS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_ITEM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_RPCS_FIELD_NUMBER: _ClassVar[int]
    STREAM_IDLE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_PENDING_BATCHES_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONNECTION_IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONNECTION_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONNECTION_AGE_GRACE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_items: int
    max_labels: int
    max_text_chars: int
    max_queue_items: int
    max_sequence_tokens: int
    max_item_tokens: int
    max_queue_tokens: int
    max_request_tokens: int
    max_streams: int
    max_concurrent_rpcs: int
    stream_idle_timeout_ms: int
    max_pending_batches: int
    keepalive_time_ms: int
    keepalive_timeout_ms: int
    max_connection_idle_ms: int
    max_connection_age_ms: int
    max_connection_age_grace_ms: int
    max_message_bytes: int
    pool_bytes: int
    def __init__(self, max_items: _Optional[int] = ..., max_labels: _Optional[int] = ..., max_text_chars: _Optional[int] = ..., max_queue_items: _Optional[int] = ..., max_sequence_tokens: _Optional[int] = ..., max_item_tokens: _Optional[int] = ..., max_queue_tokens: _Optional[int] = ..., max_request_tokens: _Optional[int] = ..., max_streams: _Optional[int] = ..., max_concurrent_rpcs: _Optional[int] = ..., stream_idle_timeout_ms: _Optional[int] = ..., max_pending_batches: _Optional[int] = ..., keepalive_time_ms: _Optional[int] = ..., keepalive_timeout_ms: _Optional[int] = ..., max_connection_idle_ms: _Optional[int] = ..., max_connection_age_ms: _Optional[int] = ..., max_connection_age_grace_ms: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., pool_bytes: _Optional[int] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "family", "vocab_size", "context_length", "dtype", "devices", "limits", "has_tokenizer", "attention", "version", "template", "call_shapes_ready", "call_shapes", "sliding_window", "max_position_embeddings", "tp_size", "dp_size", "head", "label_names", "quantization", "activation_quantization", "quantized_projections", "weight_bytes_per_device", "template_reason", "pooling", "embedding_dimensions", "prompt_names", "embedding_modality")
    class QuantizedProjectionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    CALL_SHAPES_READY_FIELD_NUMBER: _ClassVar[int]
    CALL_SHAPES_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    LABEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    QUANTIZED_PROJECTIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_PER_DEVICE_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_REASON_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAMES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_MODALITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    family: str
    vocab_size: int
    context_length: int
    dtype: str
    devices: _containers.RepeatedScalarFieldContainer[str]
    limits: Limits
    has_tokenizer: bool
    attention: str
    version: str
    template: str
    call_shapes_ready: int
    call_shapes: int
    sliding_window: int
    max_position_embeddings: int
    tp_size: int
    dp_size: int
    head: str
    label_names: _containers.RepeatedScalarFieldContainer[str]
    quantization: str
    activation_quantization: str
    quantized_projections: _containers.ScalarMap[str, str]
    weight_bytes_per_device: int
    template_reason: str
    pooling: str
    embedding_dimensions: int
    prompt_names: _containers.RepeatedScalarFieldContainer[str]
    embedding_modality: str
    def __init__(self, model: _Optional[str] = ..., family: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., dtype: _Optional[str] = ..., devices: _Optional[_Iterable[str]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., has_tokenizer: _Optional[bool] = ..., attention: _Optional[str] = ..., version: _Optional[str] = ..., template: _Optional[str] = ..., call_shapes_ready: _Optional[int] = ..., call_shapes: _Optional[int] = ..., sliding_window: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., tp_size: _Optional[int] = ..., dp_size: _Optional[int] = ..., head: _Optional[str] = ..., label_names: _Optional[_Iterable[str]] = ..., quantization: _Optional[str] = ..., activation_quantization: _Optional[str] = ..., quantized_projections: _Optional[_Mapping[str, str]] = ..., weight_bytes_per_device: _Optional[int] = ..., template_reason: _Optional[str] = ..., pooling: _Optional[str] = ..., embedding_dimensions: _Optional[int] = ..., prompt_names: _Optional[_Iterable[str]] = ..., embedding_modality: _Optional[str] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("query", "documents", "instruction", "top_n", "return_documents", "max_tokens_per_doc", "truncate", "check_tokenization", "truncation_side")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_DOC_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    CHECK_TOKENIZATION_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_SIDE_FIELD_NUMBER: _ClassVar[int]
    query: str
    documents: _containers.RepeatedScalarFieldContainer[str]
    instruction: str
    top_n: int
    return_documents: bool
    max_tokens_per_doc: int
    truncate: Truncate
    check_tokenization: bool
    truncation_side: TruncationSide
    def __init__(self, query: _Optional[str] = ..., documents: _Optional[_Iterable[str]] = ..., instruction: _Optional[str] = ..., top_n: _Optional[int] = ..., return_documents: _Optional[bool] = ..., max_tokens_per_doc: _Optional[int] = ..., truncate: _Optional[_Union[Truncate, str]] = ..., check_tokenization: _Optional[bool] = ..., truncation_side: _Optional[_Union[TruncationSide, str]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("inputs", "prompt_name", "prompt", "dimensions", "normalize", "truncate", "truncation_side")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_SIDE_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[Input]
    prompt_name: str
    prompt: str
    dimensions: int
    normalize: bool
    truncate: Truncate
    truncation_side: TruncationSide
    def __init__(self, inputs: _Optional[_Iterable[_Union[Input, _Mapping]]] = ..., prompt_name: _Optional[str] = ..., prompt: _Optional[str] = ..., dimensions: _Optional[int] = ..., normalize: _Optional[bool] = ..., truncate: _Optional[_Union[Truncate, str]] = ..., truncation_side: _Optional[_Union[TruncationSide, str]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class EmbedStreamOpen(_message.Message):
    __slots__ = ("prompt_name", "prompt", "dimensions", "normalize", "truncate", "truncation_side")
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_SIDE_FIELD_NUMBER: _ClassVar[int]
    prompt_name: str
    prompt: str
    dimensions: int
    normalize: bool
    truncate: Truncate
    truncation_side: TruncationSide
    def __init__(self, prompt_name: _Optional[str] = ..., prompt: _Optional[str] = ..., dimensions: _Optional[int] = ..., normalize: _Optional[bool] = ..., truncate: _Optional[_Union[Truncate, str]] = ..., truncation_side: _Optional[_Union[TruncationSide, str]] = ...) -> None: ...

class EmbedStreamRequest(_message.Message):
    __slots__ = ("open", "batch")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    open: EmbedStreamOpen
    batch: ItemBatch
    def __init__(self, open: _Optional[_Union[EmbedStreamOpen, _Mapping]] = ..., batch: _Optional[_Union[ItemBatch, _Mapping]] = ...) -> None: ...

class EmbedStreamOpened(_message.Message):
    __slots__ = ("prefix_tokens", "cached_tokens", "dimensions")
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    prefix_tokens: int
    cached_tokens: int
    dimensions: int
    def __init__(self, prefix_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., dimensions: _Optional[int] = ...) -> None: ...

class BatchEmbeddings(_message.Message):
    __slots__ = ("batch_id", "embeddings", "truncated_items")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    truncated_items: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_id: _Optional[int] = ..., embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., truncated_items: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedStreamResponse(_message.Message):
    __slots__ = ("opened", "batch", "usage", "refused")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    opened: EmbedStreamOpened
    batch: BatchEmbeddings
    usage: Usage
    refused: BatchRefused
    def __init__(self, opened: _Optional[_Union[EmbedStreamOpened, _Mapping]] = ..., batch: _Optional[_Union[BatchEmbeddings, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., refused: _Optional[_Union[BatchRefused, _Mapping]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "usage")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    usage: Usage
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class RerankResult(_message.Message):
    __slots__ = ("index", "relevance_score", "document", "joined_tokenization_differs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RELEVANCE_SCORE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    JOINED_TOKENIZATION_DIFFERS_FIELD_NUMBER: _ClassVar[int]
    index: int
    relevance_score: float
    document: str
    joined_tokenization_differs: bool
    def __init__(self, index: _Optional[int] = ..., relevance_score: _Optional[float] = ..., document: _Optional[str] = ..., joined_tokenization_differs: _Optional[bool] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("results", "usage", "template")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RerankResult]
    usage: Usage
    template: str
    def __init__(self, results: _Optional[_Iterable[_Union[RerankResult, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., template: _Optional[str] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("kind", "input")
    KIND_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    input: str
    def __init__(self, kind: _Optional[str] = ..., input: _Optional[str] = ...) -> None: ...

class RunResponse(_message.Message):
    __slots__ = ("result", "usage")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    result: str
    usage: Usage
    def __init__(self, result: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...
