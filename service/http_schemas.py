"""The HTTP API's JSON bodies as pydantic models: SGLang's /v1/score, the Cohere/Jina/vLLM
rerank shape, vLLM's and SGLang's /v1/classify, OpenAI's and vLLM's /v1/completions as scorers
send it, vLLM's /tokenize, /detokenize and /tokenizer_info, /v1/models,
the probes and SGLang's error body. The routes (service/http_api.py) declare them, so they
are also the OpenAPI document's schemas; `prefixscore batch` (offline/) validates its lines
with the same models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from prefixscore.choices import HEAD_ACTIVATIONS

if TYPE_CHECKING:
    from prefixscore.service.served_model import ServedModel


class ErrorResponse(BaseModel):
    """SGLang's (and vLLM's) error body."""

    object: Literal["error"] = "error"
    message: str
    type: str
    param: str | None = None
    code: int


class ScoringRequest(BaseModel):
    """SGLang's /v1/score request, field for field, plus prefixscore's options (all optional)."""

    model_config = ConfigDict(extra="ignore")

    query: str | list[int] | None = Field(None, description="Query text or token ids.")
    items: str | list[str] | list[list[int]] | None = Field(
        None, description="Item text(s) or token-id lists; a single string is one item."
    )
    label_token_ids: list[int] | None = Field(None, description="Token ids whose next-token probability is returned.")
    apply_softmax: bool = Field(False, description="Softmax over the label logits only (else full vocabulary).")
    item_first: bool = Field(False, description="Score item + query instead of query + item.")
    model: str | None = Field(None, description="Echoed in the response; the server serves one model.")
    labels: list[str] | None = Field(None, description="Label strings (one token each) instead of label_token_ids.")
    truncate: Literal["none", "end"] = Field(
        "none", description="An item too long for the context: 'none' rejects (SGLang), 'end' cuts it to fit."
    )
    truncation_side: Literal["left", "right"] = Field(
        "right", description="The side an item cut to fit loses tokens from: 'right' (its end) or 'left'."
    )
    query_truncation: Literal["none", "left", "right"] = Field(
        "none", description="A query over max_query_tokens (or the context): 'left' keeps its end, 'right' its start."
    )
    max_query_tokens: int | None = Field(None, ge=0, description="With query_truncation: the most query tokens kept.")
    check_tokenization: bool = Field(
        False,
        description="Text inputs: report per item whether tokenizing query + item as one string (as SGLang does) "
        "gives other tokens than prefixscore's separate tokenization.",
    )
    messages: list[dict[str, Any]] | None = Field(
        None,
        description="Instead of query: a conversation; each item is a candidate next assistant turn (a reward "
        "model's candidates), rendered by the model's chat template. The conversation is the shared prefix.",
    )
    activation: Literal[HEAD_ACTIVATIONS] | None = Field(  # type: ignore[valid-type]
        None,
        description="A classifier model (see /v1/models `head`): its logits as they are ('none'), each label's "
        "sigmoid, or their softmax; 'auto' (default): sigmoid for one label, softmax for several. Send no "
        "label_token_ids to a classifier.",
    )


class CachedTokens(BaseModel):
    cached_tokens: int


class ScoringUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: CachedTokens
    items: int
    truncated_query_tokens: int
    truncated_items: list[int]
    truncated_item_tokens: int


class ScoringResponse(BaseModel):
    """SGLang's /v1/score response."""

    scores: list[list[float]]
    model: str
    usage: ScoringUsage | None = None
    object: Literal["scoring"] = "scoring"
    joined_tokenization_differs: list[bool] | None = None
    label_names: list[str] | None = None  # a classifier: the name of each score column


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="allow")  # Cohere/Jina document objects may carry more fields

    text: str


class RerankRequest(BaseModel):
    """Cohere / Jina / vLLM rerank request."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Echoed in the response; the server serves one model.")
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(None, ge=0, description="Return the top_n most relevant documents (0 or absent: all).")
    return_documents: bool = Field(True, description="Echo each document in its result.")
    max_tokens_per_doc: int | None = Field(None, ge=0, description="Cut each document to this many tokens.")
    instruction: str | None = Field(
        None,
        description="The template's instruction (default: its record's); refused by a template whose prompt has none.",
    )
    truncate: Literal["none", "end"] = Field("end", description="A document too long to fit: 'end' cuts it.")
    truncation_side: Literal["left", "right"] = Field(
        "right", description="The side a document cut to fit loses tokens from: 'right' (its end) or 'left'."
    )
    check_tokenization: bool = False


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None
    joined_tokenization_differs: bool | None = None


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    cached_tokens: int
    documents: int
    truncated_documents: list[int]
    truncated_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "prefixscore"
    max_model_len: int  # the longest query + item served
    # the sliding layers' attention window (None: no layer slides)
    sliding_window: int | None = None
    max_position_embeddings: int  # what the model's configuration declares
    # the device mesh: devices on the model axis (tensor parallel) and the data axis (replicas)
    tp_size: int
    dp_size: int
    # several hosts as one replica: how many, and the most a row of the model axis spans
    hosts: int = 1
    model_axis_hosts: int = 1
    template: str | None = None  # None: no reranker template, /v1/rerank answers 400
    template_reason: str = ""  # why that template (named, or recognized by --template auto), or why none
    # the output head: causal_lm (label tokens' probabilities) or sequence_classification
    head: str
    label_names: list[str] | None = None  # a classifier's labels (id2label), in score column order
    # the projections' weights: none, int8 or fp8 (the embedding, attention, pool and head stay
    # in the served dtype); how 8-bit ones are multiplied (none: W8A16, dynamic, static); each
    # 8-bit projection's layout ("int8 per channel", "int8 blocks of 32 with a minimum")
    quantization: str = "none"
    activation_quantization: str | None = None
    quantized_projections: dict[str, str] | None = None
    weight_bytes_per_device: int  # the weights' bytes on the device holding the most
    # embeddings (/v1/embeddings, /embed): the pooling (lasttoken, mean, cls; None: none served),
    # the vectors' width, and the named prompts a request may ask for
    pooling: str | None = None
    embedding_dimensions: int | None = None
    prompt_names: list[str] | None = None
    # what a text input becomes: text, or message (rendered through the chat template)
    embedding_modality: str | None = None

    @classmethod
    def of(cls, served: ServedModel, created: int) -> ModelCard:
        """The card of the served model's one description (service/served_model.py): the fields
        the card shows, under OpenAI's names where it has its own, an empty one as null."""
        card = served.describe(CARD_NAMES, only=cls.model_fields)
        card.update((name, card[name] or None) for name in CARD_NULL_WHEN_EMPTY)
        return cls(created=created, **card)


# the card's spellings of ServedModel's fields, and the ones it shows as null when they are empty
CARD_NAMES = {"name": "id", "context_length": "max_model_len"}
CARD_NULL_WHEN_EMPTY = ("label_names", "activation_quantization", "quantized_projections", "prompt_names")


class EmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings request, plus sentence-transformers' prompts and TEI's truncation."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Echoed in the response; the server serves one model.")
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="Text(s), or token ids (sequences as given: no prompt, no special tokens added)."
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: a list of numbers; base64: the little-endian float32 bytes, base64-encoded."
    )
    dimensions: int | None = Field(None, description="Keep the first n dimensions, then normalize (Matryoshka).")
    user: str | None = Field(None, description="Accepted and ignored (OpenAI's end-user id).")
    prompt_name: str | None = Field(
        None, description="One of the model's named prompts (config_sentence_transformers.json); default: its default."
    )
    prompt: str | None = Field(None, description="A prompt's text put before each text input, instead of a name.")
    normalize: bool | None = Field(None, description="L2-normalize (default: as the model's Normalize module says).")
    truncate: bool = Field(False, description="Cut an input over the model's limit instead of refusing it.")
    truncation_direction: Literal["right", "left"] = Field(
        "right", description="The side of a text a cut input loses tokens from (its prompt stays)."
    )


class EmbedRequest(BaseModel):
    """Text Embeddings Inference's /embed request."""

    model_config = ConfigDict(extra="ignore")

    inputs: str | list[str] | list[int] | list[list[int]] = Field(description="Text(s), or token ids.")
    normalize: bool = Field(True, description="L2-normalize each embedding (TEI's default: true).")
    truncate: bool = Field(False, description="Cut an input over the model's limit instead of refusing it.")
    truncation_direction: Literal["Right", "Left", "right", "left"] = Field(
        "Right", description="The side of a text a cut input loses tokens from (its prompt stays)."
    )
    prompt_name: str | None = Field(None, description="One of the model's named prompts; default: its default.")
    dimensions: int | None = Field(None, description="Keep the first n dimensions, then normalize.")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a list of floats, or base64 of the float32 bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int  # every input whole, its prompt and special tokens included
    total_tokens: int
    prompt_tokens_details: CachedTokens  # the prompt's tokens read from the prefix cache


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ClassifyRequest(BaseModel):
    """vLLM's and SGLang's /v1/classify request, plus prefixscore's `activation`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Echoed in the response; the server serves one model.")
    input: str | list[str] | list[int] | list[list[int]] | None = Field(
        None, description="Text(s) or token ids to classify; inputs sharing a leading run of tokens share its prefill."
    )
    messages: list[dict[str, Any]] | list[list[dict[str, Any]]] | None = Field(
        None,
        description="Instead of input: a conversation (vLLM's chat form), or several (one result each; e.g. one "
        "conversation with each candidate assistant turn), rendered by the model's chat template.",
    )
    truncate_prompt_tokens: int | None = Field(None, description="Keep each input's last n tokens (-1: all that fit).")
    user: str | None = Field(None, description="Accepted and ignored (OpenAI's end-user id).")
    use_activation: bool | None = Field(None, description="vLLM's: false returns raw logits (activation 'none').")
    activation: Literal[HEAD_ACTIVATIONS] | None = Field(  # type: ignore[valid-type]
        None, description="As in /v1/score: a classifier's activation (default auto)."
    )


class ClassifyData(BaseModel):
    index: int
    label: str  # the label of the highest output
    probs: list[float]  # one per label, in label order
    num_classes: int


class ClassifyUsage(BaseModel):
    prompt_tokens: int  # every input whole, as a plain forward pass of each would see it
    total_tokens: int
    completion_tokens: int = 0
    # the inputs' shared leading tokens (start tokens included, whole pool pages), prefilled once
    # for all of them rather than once per input
    prefix_tokens: int
    prompt_tokens_details: CachedTokens  # of prefix_tokens, those already in the prefix cache
    truncated_inputs: list[int]  # indices of the inputs truncate_prompt_tokens cut


class ClassifyResponse(BaseModel):
    """vLLM's and SGLang's /v1/classify response."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassifyData]
    usage: ClassifyUsage


class CompletionsRequest(BaseModel):
    """OpenAI's and vLLM's /v1/completions request, as scorers send it (lm-evaluation-harness's
    `local-completions`): echo and logprobs of whole prompts, at most one new token (the greedy
    one). Generation options are declared so that a request asking for them is refused by name."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Echoed in the response; the server serves one model.")
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A text, texts, token ids or token-id lists; prompts sharing a leading run of tokens share "
        "its prefill."
    )
    echo: bool = Field(False, description="Return the prompt's tokens (and their log-probs) before the new token.")
    logprobs: int | None = Field(
        None, description="0 to 20: each position's log-prob and that many most likely tokens there."
    )
    max_tokens: int | None = Field(
        16, description="0 (echo only) or 1 (the greedy next token); more is refused: the server scores."
    )
    temperature: float | None = Field(None, description="0 or unset: the new token is the greedy one.")
    n: int | None = Field(1, description="1: one choice per prompt.")
    best_of: int | None = None
    stream: bool | None = Field(False, description="false: streaming is refused.")
    suffix: str | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    prompt_logprobs: int | None = Field(None, description="vLLM's; refused: use echo with logprobs.")
    seed: int | None = Field(None, description="Accepted and ignored: nothing is sampled.")
    user: str | None = Field(None, description="Accepted and ignored (OpenAI's end-user id).")
    add_special_tokens: bool = Field(True, description="A text prompt's special tokens (its BOS), as vLLM adds them.")
    return_tokens_as_token_ids: bool = Field(False, description='vLLM\'s: tokens as "token_id:<id>".')


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # the first prompt token's is None (it has no context)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["length"] = "length"


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionsResponse(BaseModel):
    """OpenAI's /v1/completions response."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class TokenizerInfo(BaseModel):
    """vLLM's /tokenizer_info: what a client needs to tokenize as the server does (lm-evaluation-
    harness's remote tokenizer reads the special tokens and the chat template)."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    model_max_length: int
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None
    add_bos_token: bool | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Status(BaseModel):
    status: str
    # /ready: device call shapes compiled so far, of those warm-up compiles (the rest compile in
    # the background while requests are served in the compiled ones)
    call_shapes_ready: int | None = None
    call_shapes: int | None = None


ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in [
        (400, "Bad input; `message` starts with the field at fault"),
        (413, "Over a size limit (items or tokens per request, body bytes)"),
        (429, "The queue is full; retry after the Retry-After header"),
        (503, "The model is loading or the server is draining"),
        (504, "The deadline passed before the items were scored"),
    ]
}


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize request (its completion form)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str = Field(description="The text, encoded whole as the model's tokenizer encodes a prompt.")
    add_special_tokens: bool = Field(True, description="The tokenizer's own special tokens (a BOS).")
    return_token_strs: bool = Field(False, description="Also each token's vocabulary entry.")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize request."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(description="Token ids in the served model's vocabulary.")


class DetokenizeResponse(BaseModel):
    prompt: str


class RunResponse(BaseModel):
    """POST /v1/run/{kind}: a request of any kind, answered."""

    kind: str
    result: Any = Field(description="the kind's result as JSON")
    usage: dict[str, int] = Field(description="prompt_tokens, cached_tokens (served by the prefix cache), items")
