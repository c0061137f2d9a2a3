"""The gateway's checks of a bytes model's inputs, from its declared description alone (no worker
is running): a raw body or base64 in JSON, empty or oversized blobs, bad base64, query-string
parameters, and a raw content type the model does not declare; and a user model's declared
parameters and KServe v2 tensors."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

from tests.integration.test_gateway_boundary import error_of, gateway_with
from vramguard.shared.settings import Settings

INFER = "/v1/models/pics/infer"
OCTETS = {"Content-Type": "application/octet-stream"}


def settings_with_pics(settings_factory: Callable[..., Settings], folder: Path) -> Settings:
    """A user's bytes model of at most 16 bytes per input, raw body as image/png or octet-stream."""
    path = folder / "models.toml"
    path.write_text('[pics]\nbackend = "nowhere.to_be:Found"\ndescription = "x"\ninput_kind = "bytes"\n'
                    'max_input_bytes = 16\nraw_content_types = ["image/png", "application/octet-stream"]\n'
                    'output = { kind = "json" }\n')
    return settings_factory(served_models="pics,synthetic", models_file=str(path))


async def test_bytes_inputs_are_checked_by_the_gateway(settings_factory: Callable[..., Settings],
                                                       tmp_path: Path) -> None:
    async with gateway_with(settings_with_pics(settings_factory, tmp_path)) as gateway:
        error_of(await gateway.post(INFER, content=b"", headers=OCTETS), 422, "invalid_input")
        error_of(await gateway.post(INFER, content=bytes(17), headers=OCTETS), 413, "payload_too_large")
        error_of(await gateway.post(INFER + "?top_k=99999999999999999999999", content=b"x", headers=OCTETS),
                 422, "invalid_input")  # an integer the wire cannot carry
        error_of(await gateway.post(INFER, json={"inputs": ["not base64!"]}), 422, "invalid_input")
        error_of(await gateway.post(INFER, json={"inputs": [base64.b64encode(bytes(17)).decode()]}),
                 413, "payload_too_large")
        error_of(await gateway.post(INFER, json={"inputs": [[1, 2]]}), 422, "invalid_input")
        # Valid either way: past validation, the gateway looks for a worker (none runs here).
        error_of(await gateway.post(INFER, content=b"\x89PNG", headers={"Content-Type": "image/png"}),
                 503, "unavailable")
        error_of(await gateway.post(INFER, json={"inputs": [base64.b64encode(b"\x89PNG").decode()]}),
                 503, "unavailable")
        # A raw content type the model does not declare is refused (415), naming the ones it takes.
        refused = error_of(await gateway.post(INFER, content=b"\x89PNG", headers={"Content-Type": "image/jpeg"}),
                           415, "unsupported_media_type")
        assert "image/png" in str(refused["message"])
        # A model of JSON inputs takes no raw body: only application/json.
        error_of(await gateway.post("/v1/models/synthetic/infer", content=b"\x89PNG", headers=OCTETS),
                 415, "unsupported_media_type")


async def test_a_user_models_declared_parameters_and_v2_tensors_are_checked_by_the_gateway(
    settings_factory: Callable[..., Settings], tmp_path: Path
) -> None:
    """A models-file entry's `parameters` and KServe v2 tensors drive the gateway as a built-in's do:
    an undeclared parameter or a value of the wrong type is 422 before anything is queued, the v2
    metadata shows the declared tensors, and a model without them has no v2 inference."""
    path = tmp_path / "models.toml"
    path.write_text('[echo]\nbackend = "nowhere.to_be:Found"\ndescription = "x"\ninput_kind = "json"\n'
                    'output = { kind = "json" }\n'
                    'parameters = { scale = { type = "number", description = "a factor" } }\n'
                    'inputs = [{ name = "x", datatype = "FP64", shape = [-1] }]\n'
                    'outputs = [{ name = "y", datatype = "FP64", shape = [-1] }]\n'
                    '[pics]\nbackend = "nowhere.to_be:Found"\ndescription = "x"\ninput_kind = "bytes"\n'
                    'output = { kind = "json" }\n')
    settings = settings_factory(served_models="echo,pics", models_file=str(path))
    async with gateway_with(settings) as gateway:
        echo = "/v1/models/echo/infer"
        unknown = error_of(await gateway.post(echo, json={"inputs": [1], "parameters": {"bogus": 1}}),
                           422, "invalid_input")
        assert "bogus" in str(unknown["message"]) and "scale" in str(unknown["message"])
        wrong = error_of(await gateway.post(echo, json={"inputs": [1], "parameters": {"scale": "2"}}),
                         422, "invalid_input")
        assert "must be of type number" in str(wrong["message"])
        error_of(await gateway.post(echo, json={"inputs": [1], "parameters": {"scale": 2}}), 503, "unavailable")
        v2 = (await gateway.get("/v2/models/echo")).json()
        assert v2["inputs"] == [{"name": "x", "datatype": "FP64", "shape": [-1]}]
        assert v2["outputs"] == [{"name": "y", "datatype": "FP64", "shape": [-1]}]
        body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP64", "data": [1.0]}],
                "parameters": {"bogus": 1}}
        refused = await gateway.post("/v2/models/echo/infer", json=body)
        assert refused.status_code == 400 and "bogus" in refused.json()["error"]
        no_v2 = await gateway.post("/v2/models/pics/infer", json=body)
        assert no_v2.status_code == 400 and "declares no KServe v2 tensors" in no_v2.json()["error"]
