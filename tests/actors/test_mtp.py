"""The MTP layer against its formula (glm53-model.md §3.8), computed independently here.

The block's attention and MoE come from transformers' own Glm5Next DSA attention and MoE modules
(loaded with the MTP layer's checkpoint tensors); the embedding/eh_proj/norm/residual glue is
written out below. fp32, max |delta| <= 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from glm53.actors.forward_batch import ForwardBatch
from glm53.actors.loader import load_model
from tests.naive_runner import SequenceRunner

TOL = 1e-4


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.fixture(scope="module")
def setup(tiny_checkpoints):
    path = tiny_checkpoints(seed=5, layers=5, mtp=True, index_topk=8)
    model = load_model(path, with_mtp=True, progress=False)
    tensors = load_file(path / "model.safetensors")
    text = json.loads((path / "config.json").read_text())["text_config"]
    return model, tensors, text


def _reference_block(tensors: dict, text: dict, layer: int):
    """transformers' DSA attention and MoE modules holding the MTP layer's weights."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import (
        Glm5NextTextAttention,
        Glm5NextTextMoE,
    )

    cfg = Glm5NextTextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    cfg._attn_implementation = "eager"
    prefix = f"model.language_model.layers.{layer}."
    attn = Glm5NextTextAttention(cfg, layer_idx=3).eval()  # index 3: a 'full' indexer layer
    attn.load_state_dict({k[len(prefix + "self_attn."):]: v for k, v in tensors.items()
                          if k.startswith(prefix + "self_attn.")})
    moe = Glm5NextTextMoE(cfg).eval()
    n = cfg.n_routed_experts
    expert = lambda e, kind: tensors[f"{prefix}mlp.experts.{e}.{kind}_proj.weight"]  # noqa: E731
    moe.load_state_dict({
        "gate.weight": tensors[prefix + "mlp.gate.weight"],
        "gate.e_score_correction_bias": tensors[prefix + "mlp.gate.e_score_correction_bias"],
        "experts.gate_up_proj": torch.stack(
            [torch.cat([expert(e, "gate"), expert(e, "up")]) for e in range(n)]),
        "experts.down_proj": torch.stack([expert(e, "down") for e in range(n)]),
        **{f"shared_experts.{k}": tensors[f"{prefix}mlp.shared_experts.{k}"]
           for k in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")},
    })
    return attn, moe


@torch.no_grad()
def _formula(tensors, text, layer, prev_hidden, next_ids, positions):
    attn, moe = _reference_block(tensors, text, layer)
    p = f"model.language_model.layers.{layer}."
    eps = text["rms_norm_eps"]
    e = tensors["model.language_model.embed_tokens.weight"][next_ids]
    e = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(e), e)
    f = torch.cat([_rms(e, tensors[p + "enorm.weight"], eps),
                   _rms(prev_hidden, tensors[p + "hnorm.weight"], eps)], dim=-1)
    f = f @ tensors[p + "eh_proj.weight"].t()
    x = _rms(f, tensors[p + "input_layernorm.weight"], eps).unsqueeze(0)
    mask = torch.ones(1, x.shape[1], dtype=torch.bool)
    a = f + attn(x, attention_mask=mask)[0][0]
    y = moe(_rms(a, tensors[p + "post_attention_layernorm.weight"], eps).unsqueeze(0))[0]
    return _rms(a + y, tensors[p + "shared_head.norm.weight"], eps)


def _mtp_pass(model, runner: SequenceRunner, prev_hidden, next_ids, start: int):
    batch = ForwardBatch.build([start], [len(next_ids)], [0], [runner.seqs[0].blocks],
                               runner.block_size)
    return model.forward_mtp(prev_hidden, torch.tensor(next_ids), batch, runner.caches)


def test_mtp_layer_matches_formula(setup):
    model, tensors, text = setup
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (61,), generator=gen).tolist()
    runner = SequenceRunner(model, max_seqs=1, max_len=128)
    runner.add(0)
    hidden, _ = runner.step({0: ids[:-1]})  # trunk hidden h_t for t = 0..59
    next_ids = ids[1:]  # token t+1 for each t
    expected = _formula(tensors, text, model.config.mtp_layer_id, hidden,
                        torch.tensor(next_ids), torch.arange(60))
    # in two chunks, so the MTP layer's own latent/indexer caches are exercised too
    ours = torch.cat([_mtp_pass(model, runner, hidden[:37], next_ids[:37], 0),
                      _mtp_pass(model, runner, hidden[37:], next_ids[37:], 37)])
    assert (ours - expected).abs().max().item() <= TOL
    # the formula is sensitive to what it is fed: a different previous hidden changes it
    assert (ours - _formula(tensors, text, model.config.mtp_layer_id, hidden.roll(1, 0),
                            torch.tensor(next_ids), torch.arange(60))).abs().max() > 1e-2
    draft_logits = model.compute_logits(ours)
    assert draft_logits.shape == (60, model.config.vocab_size)


def test_write_mtp_cache_writes_what_the_pass_writes(setup):
    """A step that drafts nothing runs only the MTP layer's cache writes: the latent rows,
    pooled keys and open pool rows equal, bit for bit, those of the whole pass on the same
    rows (in two chunks: the second reads the first's open pool rows), and the writes are not
    a no-op."""
    model = setup[0]
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, model.config.vocab_size, (43,), generator=gen).tolist()
    runner = SequenceRunner(model, max_seqs=1, max_len=128)
    runner.add(0)
    hidden, _ = runner.step({0: ids[:-1]})
    mtp = runner.caches.mtp
    fields = ("latent", "pool_keys", "open_rows")
    before = [getattr(mtp, f).clone() for f in fields]
    for start, end in ((0, 29), (29, 42)):
        _mtp_pass(model, runner, hidden[start:end], ids[start + 1:end + 1], start)
    whole = [getattr(mtp, f).clone() for f in fields]
    for f, old in zip(fields, before, strict=True):
        getattr(mtp, f).copy_(old)
    for start, end in ((0, 29), (29, 42)):
        batch = ForwardBatch.build([start], [end - start], [0], [runner.seqs[0].blocks],
                                   runner.block_size)
        model.write_mtp_cache(hidden[start:end], torch.tensor(ids[start + 1:end + 1]), batch,
                              runner.caches)
    for f, want, old in zip(fields, whole, before, strict=True):
        assert not torch.equal(want, old), f
        assert torch.equal(getattr(mtp, f), want), f
