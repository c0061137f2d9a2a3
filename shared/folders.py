"""What a local model folder in the Hugging Face layout is, read from its own small JSON files
(config.json, modules.json, sentence_bert_config.json, the pooling and dense configs), and the
catalogue entry (ModelSpec) that serves it. Torch-free: `vramguard up`, `vramguard check`, the
gateway and the models file (`path = "..."` entries) all classify the same way; the worker then
loads the folder with transformers' and sentence-transformers' own loaders (worker/models/).

    causal LM (architectures *ForCausalLM / *LMHeadModel, a tokenizer)   -> generation (chat/completions)
    sentence-transformers (modules.json) or an encoder (*Model, a tokenizer) -> embeddings
    *ForSequenceClassification (a tokenizer)                            -> text labels and scores
    *ForImageClassification (preprocessor_config.json)                  -> image labels and scores

Anything else raises FolderError, one line naming what was found and what is supported. The
entries are plain data: shared/models.py (`folder_spec`, `load_models_file`) validates them into
ModelSpecs (this module imports nothing of vramguard's, so models.py can import it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED = ("supported: a causal LM (*ForCausalLM), a sentence-transformers folder (modules.json) or an encoder "
             "(*Model) for embeddings, *ForSequenceClassification, *ForImageClassification with its "
             "preprocessor_config.json")
# What transformers loads offline here: safetensors, or PyTorch's pickles (single or sharded).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# Weights of other frameworks or runtimes, which the worker's transformers (PyTorch) cannot load.
FOREIGN_WEIGHTS = {".gguf": "GGUF", ".h5": "TensorFlow", ".msgpack": "Flax", ".onnx": "ONNX", ".ggml": "GGML",
                   ".pte": "ExecuTorch", ".mlmodel": "Core ML", ".tflite": "TensorFlow Lite"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json",
                   "spiece.model", "sentencepiece.bpe.model")
DTYPES = ("float32", "float16", "bfloat16")
# An encoder's token window when the folder names none below its position embeddings (BERT's 512).
DEFAULT_ENCODER_WINDOW = 512
TOP_K = {"type": "integer", "description": "labels returned per input (default 5; at most the label count)"}


class FolderError(ValueError):
    """The path is not a model folder vramguard can serve; the message is one line naming what was
    found there and what is supported (`vramguard up` prints it and exits 2 before anything starts)."""


@dataclass(frozen=True, slots=True)
class FolderModel:
    """What a folder holds. kind: "generate", "embed", "classify_text" or "classify_image".
    architecture: config.json's first architecture ("" for a sentence-transformers folder without one).
    dtype: the weights' dtype from config.json (`dtype`, else `torch_dtype`), else float32."""

    path: Path
    kind: str
    architecture: str
    dtype: str
    config: dict[str, Any]
    transformer_dir: Path  # where config.json, the weights and the tokenizer are: `path`, or a
    # sentence-transformers folder's Transformer module (older ones keep it in 0_Transformer/)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise FolderError(f"{path}: not readable JSON ({type(exc).__name__}: {exc})".replace("\n", " ")) from None
    if not isinstance(value, dict):
        raise FolderError(f"{path}: expected a JSON object")
    return value


def _found(folder: Path) -> str:
    names = sorted(p.name for p in folder.iterdir())
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return f"found {shown}" if names else "it is empty"


def _foreign(folder: Path) -> list[str]:
    return sorted({f"{FOREIGN_WEIGHTS[p.suffix]} ({p.name})" for p in folder.iterdir() if p.suffix in FOREIGN_WEIGHTS})


def classify(path: str | Path) -> FolderModel:
    """Classify the folder at `path` (see the module docstring). Raises FolderError, one line, for a
    path that does not exist, a file (a GGUF file named directly included), a folder without
    config.json or weights in a format transformers loads, or an architecture of no supported kind."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise FolderError(f"{path}: no such file or folder; a model folder in the Hugging Face layout is expected "
                          "(config.json, weights, tokenizer)")
    if not folder.is_dir():
        kind = FOREIGN_WEIGHTS.get(folder.suffix)
        what = f"a {kind} file" if kind else "a file"
        raise FolderError(f"{path}: {what}, not a folder; vramguard serves a folder in the Hugging Face layout "
                          "(config.json, safetensors or pytorch_model.bin weights, tokenizer)"
                          + ("; transformers can de-quantize a GGUF file into one (save_pretrained)" if kind else ""))
    folder = folder.resolve()
    modules = folder / "modules.json"
    inner = _transformer_dir(folder) if modules.is_file() else folder
    if not (inner / "config.json").is_file():
        foreign = _foreign(inner)
        if foreign:  # a folder of GGUF (or ONNX...) files, as llama.cpp or an exporter leaves them
            raise FolderError(f"{inner}: no config.json, weights only as {', '.join(foreign)}, a format transformers "
                              "cannot load here; de-quantize or convert it and save it with save_pretrained")
        raise FolderError(f"{inner}: no config.json ({_found(inner)}); {SUPPORTED}")
    config = _read_json(inner / "config.json")
    architectures = config.get("architectures") or []
    architecture = str(architectures[0]) if isinstance(architectures, list) and architectures else ""
    kind = "embed" if modules.is_file() else _kind_of(folder, architecture, config)
    _check_weights(inner, kind, architecture)
    if kind != "classify_image" and not any((inner / name).is_file() for name in TOKENIZER_FILES):
        raise FolderError(f"{inner}: {architecture or 'the model'} needs a tokenizer (tokenizer.json, "
                          f"tokenizer_config.json, vocab files) and the folder has none ({_found(inner)})")
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return FolderModel(folder, kind, architecture, dtype if dtype in DTYPES else "float32", config, inner)


def _modules(folder: Path) -> list[dict[str, Any]]:
    """modules.json's modules (sentence-transformers' pipeline, in order); [] without the file.
    Raises FolderError for a file that is not a JSON list."""
    path = folder / "modules.json"
    if not path.is_file():
        return []
    try:
        modules = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise FolderError(f"{path}: not readable JSON ({type(exc).__name__}: {exc})".replace("\n", " ")) from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise FolderError(f"{path}: expected a JSON list of modules")
    return modules


def _transformer_dir(folder: Path) -> Path:
    """The folder of a sentence-transformers folder's Transformer module (modules.json's first
    module whose type ends with Transformer; its `path` is "" in current folders), else `folder`."""
    for module in _modules(folder):
        if str(module.get("type", "")).endswith("Transformer"):
            return (folder / str(module.get("path", ""))).resolve()
    return folder


def _kind_of(folder: Path, architecture: str, config: dict[str, Any]) -> str:
    """The kind an architecture name says (no modules.json). Raises FolderError for none."""
    if architecture.endswith(("ForCausalLM", "LMHeadModel")):
        return "generate"
    if architecture.endswith("ForSequenceClassification"):
        return "classify_text"
    if architecture.endswith("ForImageClassification"):
        if not (folder / "preprocessor_config.json").is_file():
            raise FolderError(f"{folder}: {architecture} without preprocessor_config.json (its image processor's "
                              "settings: size, mean, std); save the image processor into the folder too")
        return "classify_image"
    if re.fullmatch(r"[A-Za-z0-9]+Model", architecture) and not config.get("is_decoder"):
        return "embed"  # an encoder: sentence-transformers pools it (mean) for embeddings
    found = f"architecture {architecture}" if architecture else "no architectures"
    raise FolderError(f"{folder}: config.json names {found} (model_type {config.get('model_type', '?')}), "
                      f"which vramguard does not serve; {SUPPORTED}")


def _check_weights(folder: Path, kind: str, architecture: str) -> None:
    """Raise FolderError when no weights transformers can load here are in `folder` (sharded ones included)."""
    files = [p.name for p in folder.iterdir()]
    if any(name in WEIGHT_FILES or re.fullmatch(r"(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)", name)
           for name in files):
        return
    foreign = _foreign(folder)
    what = architecture or kind
    if foreign:
        raise FolderError(f"{folder}: {what} weights only as {', '.join(foreign)}, a format transformers cannot load "
                          "here; save the model with save_pretrained (model.safetensors)")
    raise FolderError(f"{folder}: {what} has no weights (model.safetensors or pytorch_model.bin; {_found(folder)})")


def served_name(path: str | Path) -> str:
    """The model name a folder is served under by default: its own name in lower case, every run of
    characters a model name cannot hold (shared/models.py MODEL_NAME) as one '-', with 'model-' in
    front when it does not start with a letter ("SmolLM2-135M.Instruct" -> "smollm2-135m-instruct")."""
    name = re.sub(r"[^a-z0-9_-]+", "-", Path(path).expanduser().resolve().name.lower()).strip("-")
    return name if re.match(r"[a-z]", name) else f"model-{name}".rstrip("-")


def looks_like_path(value: str) -> bool:
    """Whether --model `value` names a path rather than a catalogue name: it holds a path separator,
    starts with '.' or '~', or has a file suffix (a catalogue name has none of these)."""
    return "/" in value or "\\" in value or value.startswith((".", "~")) or bool(Path(value).suffix)


def folder_entry(path: str | Path, dtype: str | None = None) -> dict[str, Any]:
    """The catalogue entry (ModelSpec's fields as plain data, less `name`) serving the folder at
    `path` with weights in `dtype` (one of DTYPES; None: the config's). Its options name the folder
    (`path`, absolute) and the dtype; its description names the folder by its name only, as clients
    read it (GET /v1/models) and need not learn the server's paths. Raises FolderError (see
    classify, and a dtype not in DTYPES)."""
    if dtype is not None and dtype not in DTYPES:
        raise FolderError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    model = classify(path)
    options: dict[str, str | int | float | bool] = {"path": str(model.path), "dtype": dtype or model.dtype}
    return {**_ENTRIES[model.kind](model, options), "options": options}


def has_chat_template(folder: Path) -> bool:
    """Whether the tokenizer in `folder` has a chat template: a chat_template.jinja or .json file, or
    a `chat_template` in tokenizer_config.json (where transformers' AutoTokenizer finds one)."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    return config.is_file() and bool(_read_json(config).get("chat_template"))


def _generate_entry(model: FolderModel, options: dict[str, str | int | float | bool]) -> dict[str, Any]:
    options["generates"] = True
    options["chat"] = has_chat_template(model.path)  # without one: /v1/completions only
    return {
        "backend": "vramguard.worker.generate.causal_lm:CausalLMBackend",
        "description": f"{model.architecture} text generation (folder {model.path.name}): POST "
                       + ("/v1/chat/completions and " if options["chat"] else "") + "/v1/completions, streamed or not",
        "input_kind": "json",
        "output": {"kind": "json", "keys": ["next_token"], "description": "the next token after the prompt: "
                   "the worker's warm-up check (the native route refuses generative models)"},
        # As the smollm2 preset: max_batch_size bounds the running sequences; the KV plan bounds them further.
        "defaults": {"max_batch_size": 32, "max_wait_ms": 10.0, "default_timeout_ms": 300_000},
        "example": ["The capital of France is"],
    }


def embedding_dimension(model: FolderModel) -> int:
    """The length of one embedding: a Dense module's out_features when modules.json has one (the
    last), else the pooling's word_embedding_dimension times its pooling modes, else hidden_size.
    Raises FolderError when these are missing or not positive whole numbers."""
    width = _size(model.config, ("hidden_size", "d_model"), 0, model.path / "config.json")
    for module in _modules(model.path):
        kind, sub = str(module.get("type", "")), model.path / str(module.get("path", ""))
        if kind.endswith("Pooling") and (sub / "config.json").is_file():
            pooling = _read_json(sub / "config.json")
            modes = sum(1 for key, on in pooling.items() if key.startswith("pooling_mode_") and on is True)
            width = _size(pooling, ("word_embedding_dimension",), width, sub / "config.json") * max(1, modes)
        elif kind.endswith("Dense") and (sub / "config.json").is_file():
            width = _size(_read_json(sub / "config.json"), ("out_features",), width, sub / "config.json")
    if width < 1:
        raise FolderError(f"{model.path}: cannot tell the embedding's length (no hidden_size in config.json)")
    return width


def _size(config: dict[str, Any], keys: tuple[str, ...], default: int, where: Path) -> int:
    """The first of `keys` present in `config`, a positive int, else `default`. Raises FolderError
    naming the file and key for a value that is not one."""
    for key in keys:
        if config.get(key) is not None:
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise FolderError(f"{where}: {key} is {value!r}, not a positive whole number")
            return value
    return default


def token_window(model: FolderModel) -> int:
    """An encoder's token window: sentence_bert_config.json's max_seq_length, else the position
    embeddings (at most DEFAULT_ENCODER_WINDOW when the config names more, as BERT-style models use)."""
    st_config = model.transformer_dir / "sentence_bert_config.json"
    if st_config.is_file():
        length = _read_json(st_config).get("max_seq_length")
        if isinstance(length, int) and length >= 3:
            return length
    positions = model.config.get("max_position_embeddings")
    return min(int(positions), DEFAULT_ENCODER_WINDOW) if isinstance(positions, int) and positions >= 3 else (
        DEFAULT_ENCODER_WINDOW)


def _normalises(model: FolderModel) -> bool:
    return any(str(module.get("type", "")).endswith("Normalize") for module in _modules(model.path))


def _embed_entry(model: FolderModel, options: dict[str, str | int | float | bool]) -> dict[str, Any]:
    width = embedding_dimension(model)
    norm = "L2-normalised " if _normalises(model) else ""
    return {
        "backend": "vramguard.worker.models.embedding:SentenceEmbeddingBackend",
        "description": f"{norm}sentence embeddings, float32[{width}] per input (folder {model.path.name})",
        "input_kind": "text",
        "output": {"kind": "tensor", "datatype": "float32", "shape": [width],
                   "description": f"{norm}embedding, float32[{width}] per input"},
        "defaults": {"max_batch_size": 32, "max_wait_ms": 5.0},
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, width]}],
        "max_input_tokens": token_window(model),
        "example": ["a sentence", "another one"],
    }


LABELS_OUTPUT = {"kind": "json", "keys": ["labels"],
                 "description": '{"labels": [{"label", "index", "probability"} x top_k]}'}


def _classify_text_entry(model: FolderModel, options: dict[str, str | int | float | bool]) -> dict[str, Any]:
    return {
        "backend": "vramguard.worker.models.classifier:TextClassifierBackend",
        "description": f"{model.architecture} text classification, {_label_count(model)} labels "
                       f"(folder {model.path.name})",
        "input_kind": "text",
        "output": LABELS_OUTPUT,
        "defaults": {"max_batch_size": 32, "max_wait_ms": 5.0},
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": "labels", "datatype": "BYTES", "shape": [-1]}],
        "parameters": {"top_k": TOP_K},
        "max_input_tokens": token_window(model),
        "example": ["a sentence to classify"],
    }


def _classify_image_entry(model: FolderModel, options: dict[str, str | int | float | bool]) -> dict[str, Any]:
    return {
        "backend": "vramguard.worker.models.classifier:ImageClassifierBackend",
        "description": f"{model.architecture} image classification, {_label_count(model)} labels (folder "
                       f"{model.path.name}); JPEG/PNG/WebP/GIF/BMP images",
        "input_kind": "bytes",
        "raw_content_types": ["image/jpeg", "image/png", "image/webp", "image/gif", "image/bmp",
                              "application/octet-stream"],
        "output": LABELS_OUTPUT,
        "defaults": {"max_batch_size": 16, "max_wait_ms": 5.0},
        "inputs": [{"name": "image", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": "labels", "datatype": "BYTES", "shape": [-1]}],
        "parameters": {"top_k": TOP_K},
    }


def _label_count(model: FolderModel) -> int:
    labels = model.config.get("id2label")
    count = model.config.get("num_labels")
    return len(labels) if isinstance(labels, dict) else count if isinstance(count, int) else 2  # transformers' default


_ENTRIES = {"generate": _generate_entry, "embed": _embed_entry, "classify_text": _classify_text_entry,
            "classify_image": _classify_image_entry}
