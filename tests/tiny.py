"""The tiny checkpoints and tokenizer the tests run on, built once per test session.

`TinyCheckpoints` writes one checkpoint directory per distinct `make_tiny` spec and hands the
same path to every test that asks for that spec again (tests/conftest.py holds one per
session). `TINY` is the spec a test takes unless it needs another (fixture `tiny_checkpoint`);
`tiny_tokenizer` is the GLM-style tokenizer every tiny checkpoint carries, written alone.

The directories are shared: a test that writes into one (a manifest, a changed tensor)
copies it first.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

# 5 layers: a dense layer, KDA layers with MoE, a DSA layer (index 3) and one more KDA layer;
# the MTP layer for speculative decoding; index_topk 8 (2 pools of 4 tokens), so the DSA
# selection is really sparse in prompts of a few dozen tokens.
TINY: dict[str, Any] = dict(seed=3, layers=5, mtp=True, index_topk=8)

# Stated bounds on the mean KLD of a quantised latent cache vs a full-precision one on TINY
# (tests/actors/test_kv_cache_dtype.py measures them on random ids, tests/deployments/
# test_kld_cli.py through `glm53 kld` on text; the measured values are noted there).
FP8_KLD_BOUND = 0.015
NVFP4_KLD_BOUND = 0.03


class TinyCheckpoints:
    """spec -> checkpoint directory under `root`, each distinct spec written once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Path] = {}

    def __call__(self, **spec: Any) -> Path:
        key = json.dumps(spec, sort_keys=True)  # specs may hold lists (layer schedules)
        if key not in self._built:
            # imported here: conftest imports this module, and a session without a model
            # test should not pay for torch
            from glm53.deployments.tiny_model import make_tiny

            name = hashlib.sha256(key.encode()).hexdigest()[:16]
            self._built[key] = make_tiny(self.root / name, **spec)
        return self._built[key]
