"""The image processor: encoded image bytes -> the vision tower's flat patches (Pillow, numpy).

Reproduces transformers' Glm5NextImageProcessorPil (the test oracle): RGB (transparency
composited over white), an aspect-preserving antialiased bicubic resize into a canvas aligned to
patch_size * merge_size within [min_image_tokens, max_image_tokens] merged tokens, zero padding
to the canvas, rescale to [0, 1], CLIP mean/std normalisation, and patches of
C x temporal x patch x patch values (the frame repeated temporal_patch_size times) in block-major
order over merge x merge blocks. Bad input raises `ImageError` (a client error).
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what Pillow may decode for us


class ImageError(ValueError):
    """An image the server refuses (undecodable, unsupported, too large, too many)."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 << 20  # encoded size
    max_pixels: int = 64 << 20  # decoded width x height, checked before decoding
    max_images: int = 8  # per request


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: np.ndarray  # [P, patch_dim] float32
    grid_thw: tuple[int, int, int]  # patches: (frames, rows, columns)
    num_tokens: int  # merged tokens = placeholders in the prompt
    digest: str  # sha256 of the pixel values and grid: the image's identity for caching


@dataclass(frozen=True)
class ImageProcessor:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_image_tokens: int = 16
    max_image_tokens: int = 8000
    limits: ImageLimits = ImageLimits()

    def __call__(self, data: bytes) -> ProcessedImage:
        image = self.decode(data)
        pixels = self._canvas(_to_rgb(image))
        patches, grid_h, grid_w = self._patchify(_normalize(pixels))
        grid = (1, grid_h, grid_w)
        digest = hashlib.sha256(np.asarray(grid).tobytes() + patches.tobytes()).hexdigest()
        return ProcessedImage(patches, grid, grid_h * grid_w // self.merge_size**2, digest)

    def decode(self, data: bytes) -> Image.Image:
        if len(data) > self.limits.max_bytes:
            raise ImageError(f"an image has {len(data)} bytes; at most {self.limits.max_bytes}")
        try:
            image = Image.open(io.BytesIO(data), formats=FORMATS)
        except UnidentifiedImageError:
            raise ImageError(f"cannot decode the image (supported: {', '.join(FORMATS)})"
                             ) from None
        width, height = image.size
        if width * height > self.limits.max_pixels:  # before the pixels are decoded
            raise ImageError(f"an image has {width}x{height} pixels; at most "
                             f"{self.limits.max_pixels}")
        try:
            image.load()
        except (OSError, SyntaxError, ValueError) as exc:  # truncated or corrupt data
            raise ImageError(f"cannot decode the image: {exc}") from None
        return image

    def _canvas(self, rgb: Image.Image) -> np.ndarray:
        """Resized and zero-padded to the aligned canvas: [3, H, W] uint8."""
        factor, t = self.patch_size * self.merge_size, self.temporal_patch_size
        width, height = rgb.size
        target_h, target_w = smart_resize(t, height, width, t, factor, self.min_image_tokens,
                                          self.max_image_tokens)
        scale = min(target_h / height, target_w / width)
        if t * height * width >= t * factor**2 * self.min_image_tokens:
            scale = min(1.0, scale)  # large enough images are never enlarged
        content_h = max(1, min(target_h, math.floor(height * scale)))
        content_w = max(1, min(target_w, math.floor(width * scale)))
        if (content_h, content_w) != (height, width):
            rgb = rgb.resize((content_w, content_h), resample=Image.Resampling.BICUBIC)
        pixels = np.moveaxis(np.asarray(rgb), -1, 0)
        return np.pad(pixels, ((0, 0), (0, target_h - content_h), (0, target_w - content_w)))

    def _patchify(self, image: np.ndarray) -> tuple[np.ndarray, int, int]:
        ps, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        channels, height, width = image.shape
        grid_h, grid_w = height // ps, width // ps
        patches = image.reshape(channels, grid_h // m, m, ps, grid_w // m, m, ps)
        patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
        patches = np.broadcast_to(patches[:, :, :, :, :, None],
                                  (*patches.shape[:5], t, ps, ps))  # the frame, t times
        return np.ascontiguousarray(patches.reshape(grid_h * grid_w, -1)), grid_h, grid_w


def _to_rgb(image: Image.Image) -> Image.Image:
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image).convert("RGB")
    return image.convert("RGB")


def _normalize(pixels: np.ndarray) -> np.ndarray:
    """uint8 [3, H, W] -> float32, rescaled to [0, 1] and CLIP-normalised."""
    image = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(CLIP_MEAN, dtype=np.float32)[:, None, None]
    std = np.asarray(CLIP_STD, dtype=np.float32)[:, None, None]
    return (image - mean) / std


def smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                 min_tokens: int, max_tokens: int) -> tuple[int, int]:
    """The aligned canvas (height, width) within [min_tokens, max_tokens] tokens of
    temporal_factor x factor^2 pixels (transformers' Glm5Next `smart_resize`)."""
    per_token = temporal_factor * factor**2
    min_pixels, max_pixels = min_tokens * per_token, max_tokens * per_token

    def align(value: float) -> int:
        return math.ceil(value / factor) * factor

    frames = max(temporal_factor, round(num_frames / temporal_factor) * temporal_factor)
    aligned_h, aligned_w = align(height), align(width)
    if frames * aligned_h * aligned_w < min_pixels:
        scale = math.sqrt(min_pixels / (num_frames * height * width))
        aligned_h = align(max(1, math.ceil(height * scale)))
        aligned_w = align(max(1, math.ceil(width * scale)))
    if frames * aligned_h * aligned_w > max_pixels:
        if max_pixels < frames * factor**2:
            raise ValueError(f"max_tokens={max_tokens} is too small for one aligned patch")
        low, high = 1, height  # the largest content height whose canvas fits the budget
        aligned_h, aligned_w = factor, factor
        while low <= high:
            content_h = (low + high) // 2
            candidate_h = align(content_h)
            candidate_w = align(max(1, math.floor(width * content_h / height)))
            if frames * candidate_h * candidate_w <= max_pixels:
                aligned_h, aligned_w = candidate_h, candidate_w
                low = content_h + 1
            else:
                high = content_h - 1
    return aligned_h, aligned_w
