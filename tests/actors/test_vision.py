"""Our vision tower and the image splice vs transformers' Glm5Next on the tiny checkpoint (fp32).

The checkpoint is written by our `make-tiny` (vision tower included) and loaded by both. The
same pixels go through both towers; the multimodal prompt places each image's placeholders
between its start and end markers, as the processor does.
"""

from __future__ import annotations

import pytest
import torch

from glm53.actors.loader import load_model
from glm53.actors.models.vision import segment_attention
from tests.naive_runner import SequenceRunner

from .oracle import load_hf

TOL = 1e-4
GRIDS = [(1, 4, 6), (1, 2, 2)]  # two images: 6 and 1 placeholder tokens


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    return load_model(tiny_checkpoint, progress=False, with_vision=True), load_hf(tiny_checkpoint)


def _pixels(model, grids, seed: int = 5) -> torch.Tensor:
    rows = sum(t * h * w for t, h, w in grids)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, model.config.vision.patch_dim, generator=gen)


def _prompt(model, hf, grids) -> list[int]:
    """Text, then each image as start, placeholders, end, then text."""
    m = model.config.vision.spatial_merge_size
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 256, (11,), generator=gen).tolist()
    for t, h, w in grids:
        ids += [hf.config.image_start_token_id] + [hf.config.image_token_id] * (t * h * w // m**2)
        ids += [hf.config.image_end_token_id] + torch.randint(0, 256, (5,), generator=gen).tolist()
    return ids


# two frames of one video-like grid and two images of one size: runs of equal-length segments,
# which segment_attention batches into one call
SAME_LENGTH_GRIDS = [(1, 2, 2), (2, 2, 4), (1, 2, 4), (1, 2, 2)]


@pytest.mark.parametrize("grids", [GRIDS, SAME_LENGTH_GRIDS], ids=["mixed", "same-length"])
def test_vision_tower_matches_transformers(models, grids):
    model, hf = models
    pixels = _pixels(model, grids)
    ours = model.visual(pixels, grids)
    with torch.no_grad():
        ref = torch.cat(hf.model.get_image_features(
            pixels, torch.tensor(grids)).pooler_output)
    merge = model.config.vision.spatial_merge_size
    rows = sum(t * h * w for t, h, w in grids) // merge**2
    assert ours.shape == ref.shape == (rows, model.config.hidden_size)
    assert ref.abs().mean() > 0.1  # not a degenerate tower
    assert (ours - ref).abs().max().item() <= TOL


def test_each_image_attends_only_to_itself(models):
    """Two images in one call give each the embeddings it gets alone."""
    model, _ = models
    pixels = _pixels(model, GRIDS)
    both = model.visual(pixels, GRIDS)
    first = model.visual(pixels[:24], GRIDS[:1])
    assert (both[:6] - first).abs().max().item() <= 1e-5


def test_segment_attention_equals_softmax_per_segment():
    """Runs of equal lengths share one fused call; each segment still sees only itself."""
    seqlens = [3, 3, 5, 2, 2, 2, 3]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(seqlens), 4, 8, generator=gen, dtype=torch.float64)
               for _ in range(3))
    ref = []
    for qs, ks, vs in zip(q.split(seqlens), k.split(seqlens), v.split(seqlens), strict=True):
        scores = torch.einsum("shd,thd->hst", qs, ks) / 8**0.5
        ref.append(torch.einsum("hst,thd->shd", scores.softmax(-1), vs))
    ref = torch.cat(ref)
    out = segment_attention(q, k, v, seqlens)
    assert out.shape == ref.shape and ref.abs().mean() > 0.1
    assert (out - ref).abs().max().item() <= 1e-12


@pytest.mark.parametrize("chunk", [None, 7])
def test_multimodal_logits_and_greedy_match_transformers(models, chunk):
    """Prompt logits (whole, or in 7-token chunks that split an image) and a greedy
    continuation equal transformers' with the same images."""
    model, hf = models
    pixels, ids = _pixels(model, GRIDS), _prompt(model, hf, GRIDS)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), pixel_values=pixels,
                 image_grid_thw=torch.tensor(GRIDS)).logits[0]
    embeds = model.visual(pixels, GRIDS)
    is_image = torch.tensor(ids) == model.config.image_token_id
    image_index = is_image.cumsum(0) - 1  # which embedding row each placeholder takes
    runner = SequenceRunner(model, max_seqs=1, max_len=len(ids) + 8)
    runner.add(0)
    logits = []
    chunk = chunk or len(ids)
    for start in range(0, len(ids), chunk):
        part = slice(start, min(start + chunk, len(ids)))
        rows = is_image[part].nonzero().flatten()
        splice = (rows, embeds[image_index[part][rows]]) if len(rows) else None
        hidden, _ = runner.step({0: ids[part]}, image_embeds=splice)
        logits.append(model.compute_logits(hidden))
    ours = torch.cat(logits)
    assert (ours - ref).abs().max().item() <= TOL
    # the images matter: with plain placeholder embeddings the logits differ
    plain = SequenceRunner(model, max_seqs=1, max_len=len(ids))
    plain.add(0)
    assert (plain.step_logits({0: ids}) - ref).abs().max().item() > 1e-2

    tokens = [int(ours[-1].argmax())]
    for _ in range(5):
        hidden, _ = runner.step({0: tokens[-1:]})
        tokens.append(int(model.compute_logits(hidden)[-1].argmax()))
    with torch.no_grad():
        hf_tokens = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels,
                                image_grid_thw=torch.tensor(GRIDS), max_new_tokens=6,
                                do_sample=False)[0, len(ids):].tolist()
    assert tokens == hf_tokens
