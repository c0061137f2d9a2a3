"""The gateway's checks of a bytes model's inputs, from its declared description alone (no worker
is running): a raw body or base64 in JSON, empty or oversized blobs, bad base64, query-string
parameters, and a raw content type the model does not declare."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

from shared.settings import Settings
from tests.integration.test_gateway_boundary import error_of, gateway_with

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
        # A raw content type the model does not declare is read as JSON, and this body is not JSON.
        error_of(await gateway.post(INFER, content=b"\x89PNG", headers={"Content-Type": "image/jpeg"}),
                 400, "invalid_input")
        # A model of JSON inputs takes no raw body.
        error_of(await gateway.post("/v1/models/synthetic/infer", content=b"\x89PNG", headers=OCTETS),
                 400, "invalid_input")
