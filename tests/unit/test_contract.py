"""The model contract without processes: the catalogue's built-in entries and the example follow
it, models-file errors name the entry, declared outputs are checked, bytes inputs are base64 in
JSON but msgpack binary on the wire, and `import vramguard` stays free of torch and FastAPI."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

from tests.helpers import ROOT
from vramguard.gateway.protocols.schemas import query_parameters, validate_inputs
from vramguard.shared.errors import InvalidInputError, PayloadTooLargeError
from vramguard.shared.models import BUILTIN, ModelsFileError, ModelSpec, OutputSpec, load_models_file
from vramguard.shared.protocol import RequestId, RequestMessage
from vramguard.worker.models import BackendContractError, check_contract, check_output, import_backend_class

# A valid user entry of JSON inputs, for the cases below to extend.
MINE = "[mine]\nbackend='a:B'\ndescription='x'\ninput_kind='json'\noutput={kind='json'}\n"
EXAMPLE_MODELS = ROOT / "examples" / "tiny_classifier" / "models.toml"


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_every_builtin_model_follows_the_contract(name: str) -> None:
    import_backend_class(BUILTIN[name])  # raises BackendContractError naming what is missing


def test_example_models_file_loads_and_its_class_follows_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE_MODELS.parent))
    spec = load_models_file(EXAMPLE_MODELS)["tiny"]
    assert spec.output == OutputSpec(kind="tensor", datatype="float32", shape=(3,), description="class probabilities")
    assert spec.example is not None and len(spec.example[0]) == 8  # make up's curl line sends it
    import_backend_class(spec)


def test_contract_check_lists_every_problem() -> None:
    class Partial:
        def load(self) -> None: ...
        def decode(self, inputs: list[object]) -> list[object]: return inputs

    spec = BUILTIN["synthetic"]
    with pytest.raises(BackendContractError) as caught:
        check_contract(spec, Partial)
    message = str(caught.value)
    assert "decode() takes 1 parameters after self, the contract passes 2" in message
    for missing in ("forward", "collate", "split", "encode", "example_inputs", "item_cost", "sample_item"):
        assert f"no method {missing}()" in message
    assert "no max_item_cost" in message


@pytest.mark.parametrize(("text", "expected"), [
    ("[minilm]\nbackend='a:B'\ndescription='x'\ninput_kind='json'\noutput={kind='json'}\n", "built-in model's name"),
    ("[mine]\nbackend='not a path'\ndescription='x'\ninput_kind='json'\noutput={kind='json'}\n", "[mine] backend"),
    ("[mine]\nbackend='a:B'\ndescription='x'\ninput_kind='json'\noutput={kind='tensor'}\n", "declares datatype"),
    ("[mine]\nbackend='a:B'\ndescription='x'\ninput_kind='json'\noutput={kind='json'}\ncolour=1\n", "[mine] colour"),
    ("[mine\n", "Expected ']'"),
    (MINE + "parameters={k={type='float', description='d'}}\n",
     "[mine] parameters.k.type"),
    (MINE + "parameters={k={type='number', description='d', x=1}}\n",
     "[mine] parameters.k.x"),
    (MINE + "inputs=[{name='i', datatype='FP64', shape=[-1]}]\n",
     "both inputs and outputs"),
    (MINE + "inputs=[{name='i', datatype='FP64', shape=[-1, 8]}]\n"
     "outputs=[{name='o', datatype='FP64', shape=[-1]}]\n", "one element per row"),
    (MINE + "inputs=[{name='i', datatype='FP64', shape=[-1]}]\n"
     "outputs=[{name='o', datatype='float32', shape=[-1]}]\n", "datatype 'float32'"),
    (MINE + "max_input_tokens=128\n", "needs input_kind = 'text'"),
    (MINE.replace("input_kind='json'", "input_kind='text'") + "example=[1, 2]\n", "a text model's inputs are strings"),
    (MINE + "example=[]\n", "[mine] example"),
])
def test_models_file_errors_name_the_entry(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "models.toml"
    path.write_text(text)
    with pytest.raises(ModelsFileError, match=r".*") as caught:
        load_models_file(path)
    assert expected in str(caught.value) and str(path) in str(caught.value)


def test_models_file_entry_declares_parameters_tensors_and_a_token_window(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text("[mine]\nbackend='a:B'\ndescription='x'\ninput_kind='text'\n"
                    "output={kind='tensor', datatype='float32', shape=[4]}\nmax_input_tokens=64\n"
                    "parameters={truncate={type='boolean', description='cut'}}\n"
                    "inputs=[{name='text', datatype='BYTES', shape=[-1]}]\n"
                    "outputs=[{name='embedding', datatype='FP32', shape=[-1, 4]}]\n")
    spec = load_models_file(path)["mine"]
    assert spec.parameters["truncate"].type == "boolean" and spec.max_input_tokens == 64
    assert spec.max_input_chars == 64 * 100
    assert [(t.name, t.datatype, t.shape) for t in (*spec.inputs, *spec.outputs)] == [
        ("text", "BYTES", (-1,)), ("embedding", "FP32", (-1, 4))]


def test_missing_models_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelsFileError, match="nope.toml"):
        load_models_file(tmp_path / "nope.toml")


def test_declared_tensor_output_is_checked() -> None:
    spec = BUILTIN["minilm"]
    check_output(spec, np.zeros(384, dtype=np.float32))
    for wrong, problem in [(np.zeros(384, dtype=np.float64), "dtype float64"), (np.zeros(383, np.float32), "[383]"),
                           ([0.0] * 384, "not a numpy array")]:
        with pytest.raises(BackendContractError, match="minilm"):
            check_output(spec, wrong)
        with pytest.raises(BackendContractError) as caught:
            check_output(spec, wrong)
        assert problem in str(caught.value)


def test_declared_json_output_is_checked() -> None:
    spec = BUILTIN["efficientnet"]
    check_output(spec, {"labels": [{"label": "tench", "index": 0, "probability": 0.5}]})
    with pytest.raises(BackendContractError, match=r"without the keys \['labels'\]"):
        check_output(spec, {"classes": []})
    with pytest.raises(BackendContractError, match="cannot travel on the wire"):
        check_output(spec, {"labels": object()})


def spec_of_bytes(max_input_bytes: int = 10) -> ModelSpec:
    return BUILTIN["efficientnet"].model_copy(update={"max_input_bytes": max_input_bytes})


def test_bytes_inputs_are_base64_in_json_and_binary_on_the_wire() -> None:
    blob = bytes(range(10))
    inputs = validate_inputs(spec_of_bytes(), [base64.b64encode(blob).decode()])
    assert inputs == [blob]
    wire = RequestMessage(RequestId("r"), "efficientnet", inputs, "reply", 1, 1).encode()
    raw = msgpack.unpackb(wire, raw=True)  # raw=True: a str would come back as bytes too; bin is what we assert
    assert raw[b"inputs"] == [blob]
    assert base64.b64encode(blob) not in wire
    assert msgpack.packb(blob, use_bin_type=True) in wire  # bin 8 header + the bytes, not a str


@pytest.mark.parametrize(("value", "error"), [
    ("not base64!", InvalidInputError), ("", InvalidInputError), (3, InvalidInputError),
    (base64.b64encode(bytes(11)).decode(), PayloadTooLargeError),
])
def test_bad_bytes_inputs_are_refused(value: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        validate_inputs(spec_of_bytes(), [value])  # type: ignore[list-item]


def test_query_parameters_read_json_scalars() -> None:
    assert query_parameters({"top_k": "3", "logits": "true", "name": "x", "big": "1e999"}) == {
        "top_k": 3, "logits": True, "name": "x", "big": "1e999"}


def test_importing_the_contract_pulls_in_neither_torch_nor_fastapi() -> None:
    code = "import sys, vramguard; print(sorted({'torch', 'fastapi'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("backend", ["vramguard.worker.models.openai_engine:OpenAIEmbeddingsBackend",
                                     "vramguard.worker.models.kserve_engine:KServeV2Backend"])
def test_engine_backends_follow_the_contract(backend: str) -> None:
    import_backend_class(BUILTIN["minilm"].model_copy(update={"backend": backend}))
