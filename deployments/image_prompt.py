"""Images in chat prompts: `image_url` content parts in, the engine's `ImageInput`s out.

The chat template sees each image as an `{"type": "image"}` part and renders it as
`<|begin_of_image|><|image|><|end_of_image|>`; after tokenising, each image's one `<|image|>`
becomes as many placeholders as the image has embeddings (transformers' Glm5NextProcessor does
the same), so token usage counts image tokens. Every refusal is an `ImageError` (a 400).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from glm53.raycluster.api import ImageInput

from .config import ImageConfig
from .image_urls import image_bytes
from .images import ImageError, ImageLimits, ImageProcessor, ProcessedImage

IMAGE_TOKEN = "<|image|>"
NO_VISION = ("image inputs need a vision deployment (this one serves text only; start it with "
             "--vision or the mm-dflash2 profile)")


def image_urls(messages: Iterable[dict[str, Any]]) -> list[str]:
    """The URLs of the messages' image parts, in prompt order; each part is replaced by the
    template's `{"type": "image"}` (the messages are changed in place)."""
    urls = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for i, part in enumerate(content):
            if part.get("type") == "image_url":
                urls.append(part["image_url"]["url"])
                content[i] = {"type": "image"}
    return urls


class ImagePrompts:
    """The vision side of one deployment: its processor, limits and placeholder id."""

    def __init__(self, config: ImageConfig, model_dir: Path, model_config: Any,
                 tokenizer: Any) -> None:
        vision = model_config.vision
        if vision is None:
            raise ValueError(f"{model_dir} has no vision tower (no vision_config): serve it "
                             "without --vision")
        self.config = config
        self.image_token_id = model_config.image_token_id
        if tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) != self.image_token_id:
            raise ValueError(f"the tokenizer's {IMAGE_TOKEN} is not the model's image_token_id "
                             f"{self.image_token_id}")
        pre = _preprocessor_config(model_dir)
        self.processor = ImageProcessor(
            patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size,
            min_image_tokens=pre.get("min_image_tokens", 16),
            max_image_tokens=min(pre.get("max_image_tokens", 8000), config.max_tokens),
            limits=ImageLimits(config.max_bytes, config.max_pixels, config.max_images))

    def process(self, urls: list[str]) -> list[ProcessedImage]:
        if len(urls) > self.config.max_images:
            raise ImageError(f"the request has {len(urls)} images; at most "
                             f"{self.config.max_images}")
        c = self.config
        return [self.processor(image_bytes(url, c.max_bytes, c.fetch_urls, c.fetch_timeout_s))
                for url in urls]

    def expand(self, ids: list[int], images: list[ProcessedImage]
               ) -> tuple[list[int], list[ImageInput]]:
        """Each image's placeholder repeated once per embedding, and the images' positions."""
        found = ids.count(self.image_token_id)
        if found != len(images):
            raise ImageError(f"the prompt has {found} image placeholders for {len(images)} "
                             "images (is <|image|> typed into a text part?)")
        out: list[int] = []
        inputs: list[ImageInput] = []
        pending = iter(images)
        for token in ids:
            if token != self.image_token_id:
                out.append(token)
                continue
            image = next(pending)
            inputs.append(ImageInput(image.pixel_values, image.grid_thw, len(out),
                                     image.num_tokens, image.digest))
            out += [token] * image.num_tokens
        return out, inputs


def _preprocessor_config(model_dir: Path) -> dict[str, Any]:
    """The checkpoint's processor settings (token bounds per image), if it ships them."""
    path = model_dir / "preprocessor_config.json"
    return json.loads(path.read_text()) if path.exists() else {}
