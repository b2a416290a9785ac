"""The embedded tiny checkpoint: a random GLM-5.3-Flash of toy size with the GLM-style tokenizer.

`make_tiny` writes one (weights + config + tokenizer, release layout); `embedded_tiny_model`
builds the default one once into the cache directory and reuses it (what `make serve` serves
when no model is given).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from glm53.raycluster.api import (
    cache_dir,
    exl3_quantization_config,
    tiny_release_config,
    tiny_text_config,
    write_tiny_checkpoint,
)

from .provenance import write_manifest
from .tiny_tokenizer import SPECIAL_TOKEN_IDS, TINY_VOCAB_SIZE, write_tiny_tokenizer

# Bump when the tiny model's layout or values change, so stale cached copies are rebuilt.
EMBEDDED_TINY_VERSION = 4  # 4: a vision tower and image tokens
IMAGE_TOKENS = {"image_start_token_id": "<|begin_of_image|>",
                "image_end_token_id": "<|end_of_image|>", "image_token_id": "<|image|>"}


# EXL3 rotates features in 128-blocks: hidden and expert widths must be multiples of 128
EXL3_TINY_SIZES = {"hidden_size": 128, "moe_intermediate_size": 128}


def make_tiny(out_dir: str | Path, seed: int = 0, layers: int = 5, mtp: bool = False,
              exl3: bool = False, **text_overrides) -> Path:
    """Write a complete tiny checkpoint directory and return its path. `exl3`: the routed
    experts are EXL3 K4 (MCG codebook) with random codes and sign vectors, as in the seed
    checkpoint (hidden and expert widths default to 128, the Hadamard block)."""
    if exl3:
        text_overrides = {**EXL3_TINY_SIZES, **text_overrides}
    if layers < 4:
        raise ValueError("a tiny model needs >= 4 layers so that it has a DSA layer (index 3)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tiny_tokenizer(out)
    text = tiny_text_config(layers, mtp=mtp, **text_overrides)
    if text["vocab_size"] < ids.vocab_size:
        raise ValueError(f"vocab_size {text['vocab_size']} < tokenizer size {ids.vocab_size}")
    config = tiny_release_config(text, eos_token_ids=ids.eos_token_ids,
                                 pad_token_id=ids.pad_token_id)
    image_ids = {name: SPECIAL_TOKEN_IDS[token] for name, token in IMAGE_TOKENS.items()}
    if any(config[name] != i for name, i in image_ids.items()) or config[
            "video_token_id"] < ids.vocab_size:
        raise ValueError(f"vocab_size {text['vocab_size']}: the tiny image placeholders must "
                         f"sit at the tokenizer's ids ({TINY_VOCAB_SIZE + 1} tokens)")
    if exl3:
        config["quantization_config"] = exl3_quantization_config()
    return write_tiny_checkpoint(out, config, seed=seed)


def embedded_tiny_model() -> Path:
    """Path of the embedded tiny checkpoint, built on first use (atomically)."""
    target = cache_dir() / f"tiny-v{EMBEDDED_TINY_VERSION}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        make_tiny(staging, seed=0, mtp=True)
        write_manifest(staging, progress=False)  # so its digest shows where it is served
        try:
            staging.rename(target)
        except OSError:  # another process won the race; use its copy
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
