"""The worker's backends for model folders, in process on the CPU over tiny folders built here (no
Redis, no download): an image classifier's labels from its id2label through its image processor, a
plain encoder's embedding as sentence-transformers' mean pooling, and `vramguard profile --model PATH`."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.model_folders import ID2LABEL, build_tiny_classifier, build_tiny_encoder, build_tiny_image_classifier
from vramguard.shared.errors import InputTooLongError, InvalidInputError
from vramguard.shared.settings import Settings
from vramguard.worker.batch.execute import run_batch
from vramguard.worker.memory.profile import main as profile_main
from vramguard.worker.models import check_output, create_backend


def _settings(tmp_path: Path, folder: Path, extra: str = "") -> Settings:
    (tmp_path / "models.toml").write_text(f'[tiny]\npath = "{folder}"\n{extra}')
    return Settings(model="tiny", served_models=["tiny"], models_file=str(tmp_path / "models.toml"))


def _outputs(backend: object, items: list[object]) -> list[object]:
    """The encoded output of each item, through the worker's own batch runner."""
    results, _ = run_batch(backend, items, 16)  # type: ignore[arg-type]
    assert all(r.ok for r in results), results
    return [r.output for r in results]


def _png(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def test_an_image_classifier_folder_labels_images_with_its_id2label(tmp_path: Path) -> None:
    settings = _settings(tmp_path, build_tiny_image_classifier(tmp_path / "vit"))
    backend = create_backend(settings, "cpu")
    backend.load()
    items = backend.decode([_png((200, 10, 10)), _png((10, 10, 200), (300, 90))], {"top_k": 2})
    outputs = _outputs(backend, items)
    for output in outputs:
        check_output(settings.spec_for("tiny"), output)
        labels = output["labels"]  # type: ignore[index]
        assert len(labels) == 2 and {d["label"] for d in labels} <= set(ID2LABEL.values())
        assert all(ID2LABEL[d["index"]] == d["label"] for d in labels)
    with pytest.raises(InvalidInputError, match=r"inputs\[0\]: not an image in a format this model takes"):
        backend.decode([b"not an image"], {})
    with pytest.raises(InvalidInputError, match="parameters.top_k must be a positive integer"):
        backend.decode([_png((0, 0, 0))], {"top_k": 0})


def test_a_text_classifier_folder_refuses_a_text_over_its_window_unless_truncated(tmp_path: Path) -> None:
    settings = _settings(tmp_path, build_tiny_classifier(tmp_path / "cls"))
    backend = create_backend(settings, "cpu")
    backend.load()
    with pytest.raises(InputTooLongError, match=r"inputs\[0\]: 202 tokens, more than the model's 64"):
        backend.decode(["good " * 200], {})
    (item,) = backend.decode(["good " * 200], {"truncate": True})
    assert backend.item_cost(item) == 64
    assert [d["label"] for d in _outputs(backend, [item])[0]["labels"]] != []  # type: ignore[index]


def test_the_dtype_of_a_models_file_entry_is_the_dtype_the_weights_load_in(tmp_path: Path) -> None:
    import torch

    settings = _settings(tmp_path, build_tiny_classifier(tmp_path / "cls"), 'dtype = "bfloat16"\n')
    backend = create_backend(settings, "cpu")
    backend.load()
    assert next(backend._model.parameters()).dtype == torch.bfloat16  # type: ignore[attr-defined]
    (output,) = _outputs(backend, backend.decode(["good movie"], {}))
    check_output(settings.spec_for("tiny"), output)


def test_a_plain_encoder_folder_embeds_by_mean_pooling(tmp_path: Path) -> None:
    import torch
    import transformers

    folder = build_tiny_encoder(tmp_path / "enc")
    settings = _settings(tmp_path, folder)
    assert settings.spec_for("tiny").output.shape == (16,) and settings.spec_for("tiny").max_input_tokens == 64
    backend = create_backend(settings, "cpu")
    backend.load()
    (vector,) = _outputs(backend, backend.decode(["the movie was good"], {}))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.inference_mode():
        hidden = transformers.AutoModel.from_pretrained(folder)(**tokenizer(["the movie was good"],
                                                                            return_tensors="pt")).last_hidden_state
    np.testing.assert_allclose(vector, hidden.mean(1)[0].numpy(), atol=1e-5)


def test_profile_measures_a_folder_by_path_and_refuses_an_empty_one(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    folder = build_tiny_classifier(tmp_path / "Tiny-Cls")
    assert profile_main(["--model", str(folder), "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == "tiny-cls" and result["device"] == "cpu" and result["max_item_cost"] == 64
    (tmp_path / "empty").mkdir()
    assert profile_main(["--model", str(tmp_path / "empty"), "--device", "cpu"]) == 2
    assert "empty: no config.json (it is empty)" in capsys.readouterr().err
