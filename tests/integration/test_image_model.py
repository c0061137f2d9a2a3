"""The efficientnet image classifier through real processes: a real photo classified sensibly, as
base64 in JSON, as a raw body and through tritonclient (KServe v2); hostile images each get a
clear 4xx or a correct answer, sent together so they share batches with good ones, and the
worker survives them all."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http.aio as triton_aio
from matplotlib import cbook
from PIL import Image

from tests.helpers import Stack

HOPPER = cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)  # ships with matplotlib


def encoded(image: Image.Image, format: str = "PNG", **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **options)
    return buffer.getvalue()


def with_size(png: bytes, width: int, height: int) -> bytes:
    """`png` whose header (IHDR, the first chunk) declares width x height, its CRC fixed: what a
    decoder sizes its work by, before reading any pixel."""
    ihdr = bytearray(png[12:29])  # chunk type, then width, height (big-endian) and 5 bytes of format
    ihdr[4:12] = struct.pack(">II", width, height)
    return png[:12] + bytes(ihdr) + struct.pack(">I", zlib.crc32(ihdr)) + png[33:]


def many_scans(photo: bytes, scans: int) -> bytes:
    """A small progressive JPEG of `photo` whose last scan is repeated until it has `scans` scans
    (each a full pass over the image; libjpeg only warns about the repeats)."""
    small = encoded(Image.open(io.BytesIO(photo)).convert("RGB").resize((64, 64)), "JPEG", progressive=True)
    last = small.rindex(b"\xff\xda")
    return small[:last] + small[last:-2] * (scans - small.count(b"\xff\xda") + 1) + small[-2:]


def hostile_images(photo: bytes) -> dict[str, tuple[bytes, set[int]]]:
    """name -> (bytes, the statuses that are a correct answer)."""
    sixteen_bit = Image.fromarray((np.arange(48 * 64).reshape(48, 64) * 20).astype(np.uint16))
    assert sixteen_bit.mode == "I;16"
    return {
        "TIFF": (encoded(Image.new("RGB", (8, 8)), "TIFF"), {422}),  # a format not on the model's list
        "3000-scan JPEG": (many_scans(photo, 3000), {422}),
        # 36 megapixels, under the pixel bound, but 144 MB as Pillow holds RGBA: over the bytes bound.
        "6000x6000 RGBA PNG": (with_size(encoded(Image.new("RGBA", (1, 1))), 6000, 6000), {413}),
        "truncated": (photo[: len(photo) // 2], {422}),  # the messages: test_bad_images_are_named_plainly
        "not an image": (b"%PDF-1.4 certainly not a picture", {422}),
        "20000x20000 bomb": (encoded(Image.new("1", (20_000, 20_000))), {413}),  # ~50 KB of PNG
        "1x1": (encoded(Image.new("RGB", (1, 1), (255, 0, 0))), {200}),
        "CMYK JPEG": (encoded(Image.open(io.BytesIO(photo)).convert("CMYK"), "JPEG"), {200}),
        "16-bit PNG": (encoded(sixteen_bit), {200}),
        "10000x1": (encoded(Image.new("RGB", (10_000, 1))), {200}),
    }


@pytest.mark.slow
async def test_image_classifier_end_to_end_with_hostile_inputs(stack: Stack) -> None:
    stack.start_gateway(served_models="efficientnet")
    worker = stack.start_worker(model="efficientnet", models__efficientnet__max_wait_ms=50)
    await stack.wait_ready()
    photo = Path(HOPPER).read_bytes()
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
        # 1. Base64 in JSON: Grace Hopper in uniform; top_k honoured; logits on request.
        body = {"inputs": [base64.b64encode(photo).decode()], "parameters": {"top_k": 3, "logits": True}}
        response = await client.post("/v1/models/efficientnet/infer", json=body)
        assert response.status_code == 200, response.text
        (output,) = response.json()["outputs"]
        assert len(output["labels"]) == 3 and len(output["logits"]) == 1000
        assert "military uniform" in [label["label"] for label in output["labels"]], output["labels"]

        # 2. The raw body, one image per request; parameters from the query string; default top_k 5.
        raw = await client.post("/v1/models/efficientnet/infer", content=photo, headers={"Content-Type": "image/jpeg"})
        assert raw.status_code == 200, raw.text
        labels = raw.json()["outputs"][0]["labels"]
        assert len(labels) == 5 and "logits" not in raw.json()["outputs"][0]
        assert labels[0]["probability"] >= labels[-1]["probability"] > 0
        bad_k = await client.post("/v1/models/efficientnet/infer?top_k=0", content=photo,
                                  headers={"Content-Type": "application/octet-stream"})
        assert bad_k.status_code == 422 and "top_k" in bad_k.json()["error"]["message"]

        # 3. Hostile images, all at once with good ones so they share batches.
        cases = hostile_images(photo)
        sends = [client.post("/v1/models/efficientnet/infer", content=blob,
                             headers={"Content-Type": "application/octet-stream"}) for blob, _ in cases.values()]
        sends += [client.post("/v1/models/efficientnet/infer", content=photo,
                              headers={"Content-Type": "image/jpeg"}) for _ in range(4)]
        replies = await asyncio.gather(*sends)
        for (name, (_, allowed)), reply in zip(cases.items(), replies, strict=False):
            assert reply.status_code in allowed, (name, reply.status_code, reply.text)
            if reply.status_code != 200:
                message = reply.json()["error"]["message"]
                # Plain words for the client, never Pillow's exception text (class names, object reprs).
                assert message and "Error" not in message and " at 0x" not in message, (name, message)
        messages = {name: reply.json()["error"]["message"] for name, reply in zip(cases, replies, strict=False)
                    if reply.status_code != 200}
        assert "truncated or corrupt" in messages["truncated"]
        assert "not an image" in messages["not an image"]
        assert "(JPEG, PNG, WebP, GIF, BMP)" in messages["TIFF"]
        assert "3000 scans" in messages["3000-scan JPEG"] and "144000000 bytes" in messages["6000x6000 RGBA PNG"]
        assert all(r.status_code == 200 for r in replies[len(cases):])

        # 4. The worker is alive and still answers.
        assert worker.poll() is None, stack.logs()
        again = await client.post("/v1/models/efficientnet/infer", content=photo,
                                  headers={"Content-Type": "image/jpeg"})
        assert again.status_code == 200
    await classify_through_kserve_v2(stack, photo)


async def classify_through_kserve_v2(stack: Stack, photo: bytes) -> None:
    """tritonclient, unmodified: the image as a binary BYTES element and as base64 text in JSON,
    `parameters` passed through; each output element is the JSON text of the native output."""
    client = triton_aio.InferenceServerClient(stack.url.removeprefix("http://"))
    try:
        meta = await client.get_model_metadata("efficientnet")
        assert meta["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [-1]}]
        for binary, element in ((True, photo), (False, base64.b64encode(photo))):
            tensor = triton_aio.InferInput("image", [1], "BYTES")
            tensor.set_data_from_numpy(np.array([element], dtype=np.object_), binary_data=binary)
            outputs = [triton_aio.InferRequestedOutput("labels", binary_data=binary)]
            result = await client.infer("efficientnet", [tensor], outputs=outputs, parameters={"top_k": 2})
            (text,) = result.as_numpy("labels")
            labels = json.loads(text)["labels"]
            assert len(labels) == 2 and "military uniform" in [label["label"] for label in labels], labels
    finally:
        await client.close()
