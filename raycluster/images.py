"""Checks that a request's images and its prompt's image placeholders agree.

The serving layer expands each image's placeholder into as many tokens as the image has
embeddings; the engine only checks the bookkeeping (it never sees pixels' meaning): every
placeholder belongs to exactly one image, each image's placeholders are consecutive, and the
pixels match the image's grid.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from glm53.actors.config import ModelConfig
from glm53.actors.step import ImageInput

from .scheduler import RequestRejectedError


def check_images(prompt_ids: Sequence[int], images: Sequence[ImageInput], cfg: ModelConfig,
                 vision: bool, max_pixel_bytes: int) -> None:
    """Raise RequestRejectedError unless `images` cover the prompt's placeholders exactly
    (`vision`: the engine built the vision tower of `cfg`) and each fits in one step's
    `max_pixel_bytes`. Without images a placeholder id is
    an ordinary token, as in the reference (which checks only when it has image features)."""
    if not images:
        return
    placeholders = np.flatnonzero(np.asarray(prompt_ids) == cfg.image_token_id)
    if not vision:
        raise RequestRejectedError("this engine serves text only (started without vision)")
    covered = []
    for image in images:
        t, h, w = image.grid_thw
        m = cfg.vision.spatial_merge_size
        shape = (t * h * w, cfg.vision.patch_dim)
        if image.pixel_values.shape != shape or h % m or w % m:
            raise RequestRejectedError(f"image pixels {image.pixel_values.shape} do not fit "
                                       f"its grid {image.grid_thw}")
        if image.pixel_values.nbytes > max_pixel_bytes:
            raise RequestRejectedError(f"an image of {image.pixel_values.nbytes} pixel bytes "
                                       f"exceeds the engine's {max_pixel_bytes} per step")
        if image.num_tokens != t * h * w // m**2:
            raise RequestRejectedError(f"an image of grid {image.grid_thw} has "
                                       f"{t * h * w // m**2} embeddings, not {image.num_tokens}")
        covered.append(np.arange(image.offset, image.offset + image.num_tokens))
    covered = np.concatenate(covered) if covered else np.zeros(0, np.int64)
    if not np.array_equal(covered, placeholders):
        raise RequestRejectedError(
            f"the prompt has {len(placeholders)} image placeholders, which the request's "
            f"{len(images)} image(s) ({len(covered)} embeddings) do not cover one for one")
