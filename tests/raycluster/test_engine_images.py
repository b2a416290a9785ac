"""Images through the engine (CPU, in-process executor, the tiny checkpoint's vision tower):
placeholders prefilled in chunks that split images, several image requests batched together,
and the bookkeeping the engine refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glm53.actors.loader import load_model
from glm53.actors.step import ImageInput, SamplingParams
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import LLMEngine
from glm53.raycluster.scheduler import RequestRejectedError
from tests.naive_runner import SequenceRunner

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint, load_model(tiny_checkpoint, progress=False, with_vision=True)


def _request(model, grids, seed: int) -> tuple[list[int], list[ImageInput]]:
    """Text, then per image: placeholders, then text; images with random pixels."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (3 + seed,), generator=gen).tolist()
    images = []
    for k, (t, h, w) in enumerate(grids):
        n = t * h * w // cfg.vision.spatial_merge_size**2
        pixels = torch.randn(t * h * w, cfg.vision.patch_dim, generator=gen).numpy()
        images.append(ImageInput(pixels, (t, h, w), len(ids), n, f"digest-{seed}-{k}"))
        ids += [cfg.image_token_id] * n + torch.randint(0, 256, (4,), generator=gen).tolist()
    return ids, images


def _reference(model, ids, images) -> list[int]:
    """Whole-prompt forward with every image spliced, then greedy decoding."""
    runner = SequenceRunner(model, max_seqs=1, max_len=len(ids) + GREEDY.max_tokens)
    runner.add(0)
    rows = torch.cat([torch.arange(i.offset, i.offset + i.num_tokens) for i in images])
    embeds = torch.cat([model.visual(torch.from_numpy(i.pixel_values), [i.grid_thw])
                        for i in images])
    hidden, _ = runner.step({0: ids}, image_embeds=(rows, embeds))
    tokens = []
    while len(tokens) < GREEDY.max_tokens:
        tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
        hidden, _ = runner.step({0: tokens[-1:]})
    return tokens


@pytest.mark.parametrize(("tokens", "tight"), [(5, False), (64, False), (64, True)])
def test_chunked_image_prefill_equals_whole_prompt(tiny, tokens, tight):
    """Three image requests run together with a text one, in steps of `tokens` tokens (5:
    chunks split every image); each output equals its whole-prompt reference, and the worker
    keeps no embeddings once the prompts are computed. `tight`: a step may carry the pixels of
    the largest image only, so chunks stop before images that do not fit."""
    path, model = tiny
    requests = [_request(model, [(1, 4, 6)], 0), _request(model, [(1, 2, 2), (1, 4, 4)], 1),
                _request(model, [(1, 6, 2)], 2), (list(range(20, 31)), [])]
    largest = max(i.pixel_values.nbytes for _, imgs in requests for i in imgs)
    engine = LLMEngine(EngineConfig(model=str(path), num_blocks=256, vision=True,
                                    max_num_batched_tokens=tokens,
                                    max_num_seqs=4,
                                    **({"max_step_image_bytes": largest} if tight else {})))
    carried = []
    execute = engine.executor.execute

    def counting(step):
        carried.append(sum(item.image.pixel_values.nbytes for item in step.images))
        return execute(step)

    engine.executor.execute = counting
    calls = []  # images per tower call
    engine.executor.runner.model.visual.register_forward_pre_hook(
        lambda tower, args: calls.append(len(args[1])))
    ids = [engine.add_request(p, GREEDY, images=imgs) for p, imgs in requests]
    assert engine.scheduler.requests[ids[1]].image_digests == ("digest-1-0", "digest-1-1")
    results: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
    for rid, (prompt, images) in zip(ids[:3], requests, strict=False):
        assert results[rid] == _reference(model, prompt, images), rid
    assert engine.executor.runner.image_embeds == {}
    assert max(carried) <= engine.config.max_step_image_bytes
    if tokens == 64:  # several images fit in one step's tokens; the pixel budget decides
        assert (max(carried) == largest) == tight
    # every image embedded once; the images of one step in one tower call
    assert sum(calls) == 4
    if tokens == 64 and not tight:
        assert max(calls) > 1


def test_image_bookkeeping_is_checked(tiny):
    path, model = tiny
    prompt, images = _request(model, [(1, 4, 6)], 0)
    text_only = LLMEngine(EngineConfig(model=str(path), num_blocks=64))
    with pytest.raises(RequestRejectedError, match="text only"):
        text_only.add_request(prompt, GREEDY, images=images)
    engine = LLMEngine(EngineConfig(model=str(path), num_blocks=64, vision=True))
    image = images[0]
    bad = [
        (prompt[:-5], images),  # an image without all its placeholders
        (prompt, [ImageInput(image.pixel_values, image.grid_thw, image.offset + 1,
                             image.num_tokens, "x")]),  # misplaced
        (prompt, [ImageInput(image.pixel_values[:-1], image.grid_thw, image.offset,
                             image.num_tokens, "x")]),  # pixels do not fit the grid
        # placeholders and the image agree, but the grid has one embedding more
        (prompt[:image.offset] + prompt[image.offset + 1:],
         [ImageInput(image.pixel_values, image.grid_thw, image.offset, image.num_tokens - 1,
                     "x")]),
    ]
    for p, imgs in bad:
        with pytest.raises(RequestRejectedError):
            engine.add_request(p, GREEDY, images=imgs)
    small = LLMEngine(EngineConfig(model=str(path), num_blocks=64, vision=True,
                                   max_step_image_bytes=image.pixel_values.nbytes - 1))
    with pytest.raises(RequestRejectedError, match="per step"):
        small.add_request(prompt, GREEDY, images=images)
    assert not engine.has_unfinished
    assert np.asarray(prompt).size  # the good request still goes through
    engine.add_request(prompt, GREEDY, images=images)
