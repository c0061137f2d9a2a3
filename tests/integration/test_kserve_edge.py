"""KServe v2 bodies the gateway refuses before anything is enqueued (in-process app, no worker):
broken binary framing, BYTES elements, non-UTF-8 text, unknown outputs, model versions; and a
well-formed binary body that gets through to admission (503: no worker runs here)."""

from __future__ import annotations

import gzip
import json
import struct

import httpx

INFER = "/v2/models/minilm/infer"


def binary_body(
    texts: list[bytes], *, size: int | None = None, header_length: int | None = None
) -> tuple[bytes, dict[str, str]]:
    """A v2 body with `texts` as binary BYTES; `size` and `header_length` override the true values."""
    raw = b"".join(struct.pack("<I", len(t)) + t for t in texts)
    head = json.dumps({"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES",
                                   "parameters": {"binary_data_size": len(raw) if size is None else size}}]}).encode()
    length = len(head) if header_length is None else header_length
    return head + raw, {"Inference-Header-Content-Length": str(length)}


async def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    message = response.json()["error"]
    assert isinstance(message, str) and message
    return message


async def test_well_formed_binary_and_gzip_bodies_reach_admission(gateway: httpx.AsyncClient) -> None:
    body, headers = binary_body([b"hello", "h\u00e9llo".encode()])
    assert (await gateway.post(INFER, content=body, headers=headers)).status_code == 503
    zipped = await gateway.post(INFER, content=gzip.compress(body), headers={**headers, "Content-Encoding": "gzip"})
    assert zipped.status_code == 503


async def test_broken_binary_framing_is_400(gateway: httpx.AsyncClient) -> None:
    body, headers = binary_body([b"hello"], header_length=10_000)
    assert "Inference-Header-Content-Length" in await error_of(await gateway.post(INFER, content=body,
                                                                                  headers=headers), 400)
    body, headers = binary_body([b"hello"], size=3)
    assert "binary_data_size" in await error_of(await gateway.post(INFER, content=body, headers=headers), 400)
    body, headers = binary_body([b"hello"])
    truncated = body[:-2]  # the element is shorter than its length prefix says
    head_len = int(headers["Inference-Header-Content-Length"])
    fixed = json.loads(truncated[:head_len])
    fixed["inputs"][0]["parameters"]["binary_data_size"] = len(truncated) - head_len
    head = json.dumps(fixed).encode()
    again = head + truncated[head_len:]
    message = await error_of(await gateway.post(INFER, content=again,
                                                headers={"Inference-Header-Content-Length": str(len(head))}), 400)
    assert "shorter" in message
    body, headers = binary_body([b"\xff\xfe"])
    assert "UTF-8" in await error_of(await gateway.post(INFER, content=body, headers=headers), 400)


async def test_unknown_output_and_version_and_json_errors(gateway: httpx.AsyncClient) -> None:
    tensor = {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a"]}
    unknown = await gateway.post(INFER, json={"inputs": [tensor], "outputs": [{"name": "nope"}]})
    assert "nope" in await error_of(unknown, 400)
    assert (await gateway.get("/v2/models/minilm/versions/2")).status_code == 404
    assert (await gateway.get("/v2/models/minilm/versions/1")).status_code == 200
    assert "JSON" in await error_of(await gateway.post(INFER, content=b"{oops"), 400)
    not_numbers = {"inputs": [{"name": "input", "shape": [2], "datatype": "FP64", "data": [1.0, "x"]}]}
    assert "FP64" in await error_of(await gateway.post("/v2/models/synthetic/infer", json=not_numbers), 400)
    two_rows = {"inputs": [{"name": "text", "shape": [1, 2], "datatype": "BYTES", "data": [["a", "b"]]}]}
    assert "one element per row" in await error_of(await gateway.post(INFER, json=two_rows), 400)


async def test_json_tensors_are_taken_as_written_or_refused(gateway: httpx.AsyncClient) -> None:
    """A shape is int64s (not "1", 1.0 or true coerced) and a null element is refused, never left
    out (which would serve [1, 2] for [1, null, 2]); a well-formed tensor reaches admission (503)."""
    synthetic = "/v2/models/synthetic/infer"

    def tensor(shape: object, data: object) -> dict[str, object]:
        return {"inputs": [{"name": "input", "shape": shape, "datatype": "FP64", "data": data}]}

    for shape in (["1"], [1.0], [True]):
        message = await error_of(await gateway.post(synthetic, json=tensor(shape, [1])), 400)
        assert "shape" in message, message
    for data in ([1, None, 2], [[1], [None], [2]], [None, None, None]):
        message = await error_of(await gateway.post(synthetic, json=tensor([3], data)), 400)
        assert "FP64 elements must be numbers" in message, (data, message)
    missing = await error_of(await gateway.post(synthetic, json=tensor([1], None)), 400)
    assert "no data" in missing, missing
    assert (await gateway.post(synthetic, json=tensor([3], [1, 2, 3]))).status_code == 503
