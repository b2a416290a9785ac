"""The image processor vs transformers' Glm5NextImageProcessorPil (the oracle), and its limits."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from glm53.deployments.images import ImageError, ImageLimits, ImageProcessor


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = len(Image.new(mode, (1, 1)).getbands())
    data = rng.integers(0, 256, (height, width, bands), dtype=np.uint8)
    return Image.fromarray(data.squeeze(-1) if bands == 1 else data, mode)


@pytest.mark.parametrize(("width", "height", "mode", "max_tokens"), [
    (300, 200, "RGB", 8000),  # kept at its size, padded to the 28-pixel grid
    (20, 90, "RGB", 8000),  # below min_image_tokens: enlarged
    (640, 480, "RGBA", 100),  # over the token budget: shrunk; alpha over white
    (333, 97, "L", 8000),  # grey
])
def test_patches_match_transformers(width, height, mode, max_tokens):
    from transformers.models.glm5_next.image_processing_pil_glm5_next import (
        Glm5NextImageProcessorPil,
    )

    image = random_image(width, height, mode)
    ref = Glm5NextImageProcessorPil()(image, max_image_tokens=max_tokens, return_tensors="np")
    ours = ImageProcessor(max_image_tokens=max_tokens)(encode(image))
    assert ours.grid_thw == tuple(ref["image_grid_thw"][0])
    assert ours.num_tokens == ours.pixel_values.shape[0] // 4 <= max_tokens
    assert ours.pixel_values.shape == ref["pixel_values"].shape
    assert np.abs(ours.pixel_values - ref["pixel_values"]).max() <= 1e-6


def test_the_digest_follows_the_pixels_not_the_encoding():
    image = random_image(64, 64)
    process = ImageProcessor()
    assert process(encode(image, "PNG")).digest == process(encode(image, "BMP")).digest
    assert process(encode(image)).digest != process(encode(random_image(64, 64, seed=1))).digest


@pytest.mark.parametrize(("data", "limits", "message"), [
    (b"not an image at all", ImageLimits(), "cannot decode"),
    (encode(random_image(64, 64))[:100], ImageLimits(), "cannot decode"),  # truncated
    (encode(random_image(64, 64), "TIFF"), ImageLimits(), "supported"),  # not an allowed type
    (encode(random_image(64, 64)), ImageLimits(max_bytes=1000), "bytes"),
    (encode(random_image(64, 64)), ImageLimits(max_pixels=4000), "pixels"),
])
def test_bad_images_are_refused(data, limits, message):
    with pytest.raises(ImageError, match=message):
        ImageProcessor(limits=limits)(data)
