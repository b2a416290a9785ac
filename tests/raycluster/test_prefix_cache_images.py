"""Prefix caching with images (CPU, the tiny checkpoint's vision tower): block hashes cover the
images in each block, so the same text with another image shares only the blocks before the
image, while the same image (same pixels, brought again by a later turn) is served from the
cache; a hit that ends inside an image prefills the rest of it; and over a multi-turn chat with
images the greedy outputs equal those of the engine without caching."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from glm53.actors.step import ImageInput, SamplingParams
from glm53.raycluster.block_pool import BlockPool
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import LLMEngine
from glm53.raycluster.prefix_cache import PrefixCache, cache_identity
from glm53.raycluster.request import Request
from glm53.raycluster.state_checkpoints import CheckpointPool

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# a checkpoint at every block: prefill chunks of 8 tokens, so a hit may stop inside an image
SMALL = dict(num_blocks=200, block_size=8, max_num_batched_tokens=16, max_num_seqs=4,
             prefix_checkpoint_interval=8, prefix_checkpoints=16, vision=True)
GRID_16, GRID_24 = (1, 8, 8), (1, 12, 8)  # 16 and 24 image tokens (2x2 merge)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return str(tiny_checkpoint)


def _engine(path: str, on: bool) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=path, enable_prefix_caching=on, **SMALL))
    engine.tower_calls = 0

    def count(*_):
        engine.tower_calls += 1

    engine.executor.runner.model.visual.register_forward_hook(count)
    return engine


def _pixels(engine: LLMEngine, seed: int, grid: tuple[int, int, int]) -> tuple:
    t, h, w = grid
    dim = engine.model_config.vision.patch_dim
    pixels = np.random.default_rng(seed).standard_normal((t * h * w, dim)).astype(np.float32)
    return pixels, grid


def _prompt(engine: LLMEngine, segments: list) -> tuple[list[int], list[ImageInput]]:
    """Token ids and images of a prompt given as segments: token lists and (pixels, grid)
    images. Each call brings its images again (copied, digested as the serving layer does:
    sha256 of the grid and the pixels), as a chat client resends its history."""
    cfg = engine.model_config
    ids: list[int] = []
    images = []
    for segment in segments:
        if isinstance(segment, list):
            ids += segment
            continue
        pixels, grid = segment[0].copy(), segment[1]
        digest = hashlib.sha256(np.asarray(grid).tobytes() + pixels.tobytes()).hexdigest()
        n = int(np.prod(grid)) // cfg.vision.spatial_merge_size**2
        images.append(ImageInput(pixels, grid, len(ids), n, digest))
        ids += [cfg.image_token_id] * n
    return ids, images


def _run(engine: LLMEngine, segments: list) -> tuple[list[int], Request]:
    """Serve one prompt alone: (greedy output, its request)."""
    ids, images = _prompt(engine, segments)
    rid = engine.add_request(ids, GREEDY, images=images)
    request = engine.scheduler.requests[rid]
    out: list[int] = []
    while engine.has_unfinished:
        for o in engine.step():
            out += o.new_token_ids
    return out, request


def _text(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 256, n).tolist()


def _chat(engine: LLMEngine) -> dict[str, tuple[list[int], Request, int]]:
    """Four turns of a chat with images; turn 3 is first aborted half way through its image
    (a client gone mid-prefill), then retried; a branch asks turn 3 with another image.
    Returns turn -> (output, request, tower calls the turn made)."""
    rng = np.random.default_rng(0)
    image_a, image_c = _pixels(engine, 1, GRID_16), _pixels(engine, 3, GRID_24)
    turns = {
        "t1": [_text(rng, 5), image_a, _text(rng, 3)],
        "t2": [_text(rng, 4), _pixels(engine, 2, GRID_24), _text(rng, 3)],
        "t3": [_text(rng, 2), image_c, _text(rng, 3)],
        "t4": [_text(rng, 3), image_a, _text(rng, 2)],  # the first image again
    }
    branch = [turns["t3"][0], _pixels(engine, 4, GRID_24), turns["t3"][2]]
    history: list = [_text(rng, 13)]
    results = {}
    for name, message in turns.items():
        if name == "t3":
            ids, images = _prompt(engine, history + message)
            request = engine.scheduler.requests[engine.add_request(ids, GREEDY, images=images)]
            image = images[-1]
            while not image.offset < request.num_computed_tokens < image.offset + 24:
                assert not request.finished
                engine.step()
            engine.abort(request.request_id)
            calls = engine.tower_calls
            results["t3-branch"] = (*_run(engine, history + branch), engine.tower_calls - calls)
        calls = engine.tower_calls
        out, request = _run(engine, history + message)
        results[name] = (out, request, engine.tower_calls - calls)
        history += message + [out]
    return results


def test_chat_with_images_equals_caching_off(tiny):
    """Greedy outputs equal with and without the cache, turn by turn; each turn's earlier
    images come from the cache (the tower runs only for the turn's new image), the retried
    turn 3 resumes inside its image, and its branch with another image stops before it."""
    off = _chat(_engine(tiny, False))
    on = _chat(_engine(tiny, True))
    assert {k: v[0] for k, v in on.items()} == {k: v[0] for k, v in off.items()}
    assert on["t3"][0] != on["t3-branch"][0]  # the image matters to the output
    for name in ("t2", "t3", "t4"):
        request = on[name][1]
        earlier = request.images[-2]  # the previous turn's image, now history
        assert request.num_cached_tokens >= earlier.offset + earlier.num_tokens, name
    # the retry resumes where the aborted turn stopped, inside its image: the tower embeds
    # the whole image again for the rest of its placeholders
    image = on["t3"][1].images[-1]
    assert image.offset < on["t3"][1].num_cached_tokens < image.offset + image.num_tokens
    assert [on[k][2] for k in ("t1", "t2", "t3", "t4")] == [1, 1, 1, 1]
    # the branch shares the history, not the blocks of the other image
    other = on["t3-branch"][1]
    assert other.num_cached_tokens == other.images[-1].offset // 8 * 8
    assert [off[k][2] for k in ("t1", "t2", "t3", "t4")] == [1, 2, 3, 4]


def test_same_text_other_image_shares_only_the_text_before_it(tiny):
    """Two prompts with the same token ids and different images: the second shares the blocks
    of the text before its image, none after, and answers as it does without the cache."""
    engine, plain = _engine(tiny, True), _engine(tiny, False)
    rng = np.random.default_rng(5)
    before, after = _text(rng, 20), _text(rng, 4)
    first = [before, _pixels(engine, 6, GRID_16), after]
    second = [before, _pixels(engine, 7, GRID_16), after]
    out_first, a = _run(engine, first)
    out_second, b = _run(engine, second)
    assert b.num_cached_tokens == 16  # blocks 0 and 1; block 2 holds the image's first tokens
    hashes_a, hashes_b = engine.prefix.hashes(a), engine.prefix.hashes(b)
    assert hashes_a[:2] == hashes_b[:2]
    assert all(x != y for x, y in zip(hashes_a[2:], hashes_b[2:], strict=False))
    assert out_second == _run(plain, second)[0] != out_first
    again, c = _run(engine, [before, _pixels(engine, 6, GRID_16), after])  # the first again
    assert again == out_first and c.num_cached_tokens == 32  # (40 - 1) // 8 blocks


def test_block_hashes_cover_the_images_in_each_block():
    """Text blocks hash as without vision; a block's hash covers each image overlapping it
    (its digest and where it starts), and the chain carries that to every later block."""
    cache = PrefixCache(BlockPool(16, 4), CheckpointPool(2), lambda i: 10 + i,
                        cache_identity("m"), 4, hash_next_token=False)
    tokens = list(range(4)) + [9] * 6 + list(range(6))  # 4 blocks; placeholders at 4..9

    def hashes(*images: tuple[str, int]) -> list[bytes]:
        inputs = tuple(ImageInput(np.zeros(0), (1, 2, 2), offset, 10 - offset, digest)
                       for digest, offset in images)
        return cache.hashes(Request("r", tokens, GREEDY, 0, images=inputs))

    text, x = hashes(), hashes(("x", 4))
    assert x[0] == text[0] and all(a != b for a, b in zip(x[1:], text[1:], strict=True))
    assert hashes(("x", 4)) == x  # the same image: the same hashes
    y = hashes(("y", 4))
    assert y[0] == x[0] and all(a != b for a, b in zip(x[1:], y[1:], strict=True))
    # the same image and tokens, the image starting one token later (a text token before it)
    assert hashes(("x", 5))[1] != x[1]


def test_image_chunk_counts_the_images_after_a_hit():
    """At admission a hit moves the chunk's start: the pixel budget is spent on the images the
    chunk computes from there, not on the cached ones before it."""
    pixels = np.zeros((16, 4), np.float32)  # 256 bytes an image
    images = tuple(ImageInput(pixels, (1, 4, 4), offset, 4, str(offset)) for offset in (2, 20))
    request = Request("r", list(range(30)), GREEDY, 0, images=images)
    assert request.image_chunk(8, 256, start=16) == (8, 256)  # the second image only
    assert request.image_chunk(8, 255, start=16) == (4, 0)  # stops before it
    assert request.image_chunk(8, 255) == (2, 0)  # from the computed tokens (none)
