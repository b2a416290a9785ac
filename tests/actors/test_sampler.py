"""The engine's sampler: SamplingInputs building, logprobs, batch independence, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glm53.actors.sampler import (
    Sampler,
    apply_token_bitmask,
    build_sampling_inputs,
    gather_logprobs,
)
from glm53.actors.step import SamplingParams
from glm53.kernels.ref import sampling

VOCAB = 40
SAMPLER = Sampler()


def test_build_sampling_inputs_carries_penalty_context_only_where_used():
    rows = [
        (SamplingParams(temperature=0.5, top_k=4, logprobs=3), 2**64 + 5, 7, [1, 2], [3], ()),
        (SamplingParams(repetition_penalty=1.2, top_p=0.9), -1, 0, [4, 5, 6], [7, 7], ()),
        (SamplingParams(temperature=0, min_p=0.2), 9, 2, [8], [9], ()),
        (SamplingParams(frequency_penalty=0.5, logprobs=0), 3, 1, np.array([], np.int64), [1],
         ()),
    ]
    s = build_sampling_inputs(rows)
    assert s.seeds.tolist() == [5, -1, 9, 3]  # wrapped to int64 bits
    assert s.positions.tolist() == [7, 0, 2, 1]
    assert s.num_logprobs.tolist() == [3, -1, -1, 0]
    assert s.top_k.tolist() == [4, 0, 0, 0] and s.top_p[1] == np.float32(0.9)
    assert s.temperature.tolist() == [0.5, 1.0, 0.0, 1.0] and s.min_p[2] == np.float32(0.2)
    assert s.prompt_offsets.tolist() == [0, 0, 3, 3, 3]
    assert s.prompt_ids.tolist() == [4, 5, 6]
    assert s.output_offsets.tolist() == [0, 0, 2, 2, 3]
    assert s.output_ids.tolist() == [7, 7, 1]
    assert s.repetition_penalty.dtype == np.float32 and s.output_ids.dtype == np.int64
    empty = build_sampling_inputs([])
    ids, logprobs = SAMPLER(torch.zeros(0, VOCAB), empty)
    assert ids.shape == (0,) and logprobs is None


def _mixed_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=g) * 2
    rows = [
        (SamplingParams(temperature=0, repetition_penalty=3.0, logprobs=2), 1, 0, [], [0, 1, 2],
         ()),
        (SamplingParams(temperature=0.7, top_k=5, logprobs=5), 2, 3, [], [], ()),
        (SamplingParams(top_p=0.6, presence_penalty=1.5, logprobs=0), 3, 9, [5], [6, 6], ()),
        (SamplingParams(min_p=0.1, frequency_penalty=-0.5), 4, 1, [], [8, 8, 8], ()),
        (SamplingParams(temperature=1.3, logprobs=1), 5, 2, [], [], ()),
        (SamplingParams(temperature=0), 6, 4, [], [], ()),
    ]
    # make the greedy row's penalty change its argmax, so "penalised, not raw" is checked
    logits[0, :3] = torch.tensor([9.0, 8.0, 7.0])
    return logits, rows


def test_logprobs_are_log_softmax_of_processed_logits():
    logits, rows = _mixed_batch()
    s = build_sampling_inputs(rows)
    ids, lp = SAMPLER(logits, s)
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in vars(s).items() if v is not None}
    penalised = sampling.apply_penalties(
        logits, t["presence_penalty"], t["frequency_penalty"], t["repetition_penalty"],
        t["prompt_ids"], t["prompt_offsets"], t["output_ids"], t["output_offsets"])
    processed = sampling.process_logits(penalised, t["temperature"], t["top_k"], t["top_p"],
                                        t["min_p"])
    assert torch.equal(ids, sampling.sample(processed, t["temperature"], t["seeds"],
                                            t["positions"]))
    assert ids[0] == penalised[0].argmax() != logits[0].argmax()
    ref = torch.log_softmax(processed, -1)
    chosen = ref.gather(1, ids.unsqueeze(1)).squeeze(1)
    assert np.allclose(lp.token_logprobs, chosen.numpy(), atol=1e-6)
    assert lp.ranks.tolist() == [1 + int((ref[r] > chosen[r]).sum()) for r in range(6)]
    assert lp.ranks[0] == 1 and lp.ranks[5] == 1  # greedy rows pick the top token
    assert lp.top_ids.shape == lp.top_logprobs.shape == (6, 5)  # K = the largest request
    for r in range(6):
        top = lp.top_logprobs[r]
        assert np.all(top[:-1] >= top[1:])  # sorted, best first (masked tokens at -inf)
        assert np.allclose(lp.top_logprobs[r], ref[r, lp.top_ids[r]].numpy(), atol=1e-6)
        assert np.isclose(lp.top_logprobs[r, 0], ref[r].max().item(), atol=1e-6)
        if lp.ranks[r] <= 5:  # the sampled token's logprob sits in the top-K at its rank
            assert np.isclose(lp.top_logprobs[r, lp.ranks[r] - 1], lp.token_logprobs[r])
    # the top-k row's logprobs cover only its 5 kept tokens: they sum to 1 there
    assert np.isclose(np.exp(lp.top_logprobs[1]).sum(), 1.0, atol=1e-5)



def test_gather_logprobs_ranks_ties_and_top_k():
    logprobs = torch.log_softmax(torch.tensor([[3.0, 1.0, 2.0, 0.0], [1.0, 1.0, 0.0, 5.0]]), -1)
    lp = gather_logprobs(logprobs, torch.tensor([2, 1]), 3)
    assert lp.ranks.tolist() == [2, 2]  # a tie with a better token does not push the rank
    assert lp.top_ids[0].tolist() == [0, 2, 1] and lp.top_ids[1, 0] == 3
    assert np.allclose(lp.token_logprobs, [logprobs[0, 2].item(), logprobs[1, 1].item()])
    assert np.allclose(lp.top_logprobs[0], logprobs[0, [0, 2, 1]].numpy())
    assert gather_logprobs(logprobs, torch.tensor([0, 3]), 0).top_ids.shape == (2, 0)

def test_no_logprobs_and_all_greedy_fast_path():
    logits, rows = _mixed_batch()
    rows = [(SamplingParams(temperature=0, repetition_penalty=p.repetition_penalty), *rest)
            for p, *rest in rows]
    ids, lp = SAMPLER(logits, build_sampling_inputs(rows))
    assert lp is None
    penalised = logits.clone()
    penalised[0, :3] /= 3.0  # row 0 alone keeps a penalty: repetition 3 on its outputs 0..2
    assert ids.tolist() == penalised.argmax(-1).tolist()

def test_seeded_row_is_the_same_alone_or_in_any_batch():
    logits, rows = _mixed_batch()
    g = torch.Generator().manual_seed(5)
    for target in range(1, 5):  # the sampled (non-greedy) rows
        alone, _ = SAMPLER(logits[target:target + 1], build_sampling_inputs([rows[target]]))
        for _ in range(3):
            perm = torch.randperm(6, generator=g)
            shuffled = [rows[i] for i in perm.tolist()]
            ids, _ = SAMPLER(logits[perm], build_sampling_inputs(shuffled))
            assert ids[perm.tolist().index(target)] == alone[0]


BAD_PARAMS = [
    dict(max_tokens=0), dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
    dict(top_k=-1), dict(min_p=1.1), dict(presence_penalty=2.5), dict(frequency_penalty=-3),
    dict(repetition_penalty=0.0), dict(min_tokens=20, max_tokens=10), dict(logprobs=21),
    dict(logprobs=-1), dict(prompt_logprobs=30),
]


@pytest.mark.parametrize("kwargs", BAD_PARAMS, ids=lambda kw: ",".join(kw))
def test_sampling_params_reject_bad_values(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_banned_tokens_are_never_drawn():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, VOCAB, generator=g)
    top2 = logits[0].topk(2).indices.tolist()
    rows = [(SamplingParams(temperature=0), 1, 0, [], [], (top2[0],)),
            (SamplingParams(temperature=1.0), 2, 0, [], [], tuple(range(1, VOCAB)))]
    s = build_sampling_inputs(rows)
    assert s.banned_offsets.tolist() == [0, 1, VOCAB]
    ids, _ = SAMPLER(logits, s)
    assert ids.tolist() == [top2[1], 0]  # greedy takes the runner-up; the other has one choice


def test_draw_distributions_are_one_hot_for_greedy_rows():
    """with_probs (speculative verification): a greedy row's distribution is the one-hot of its
    argmax, a sampled row's the softmax of its processed logits; a batch mixing both."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    greedy, hot = SamplingParams(temperature=0), SamplingParams(temperature=0.7)
    inputs = build_sampling_inputs([(greedy, 1, 0, (), (), ()), (hot, 2, 0, (), (), ()),
                                    (greedy, 3, 0, (), (), ())])
    ids, _, probs = SAMPLER(logits, inputs, with_probs=True)
    for row in (0, 2):
        assert ids[row] == logits[row].argmax()
        assert torch.equal(probs[row], torch.nn.functional.one_hot(ids[row], VOCAB).float())
    assert torch.allclose(probs[1], torch.softmax(logits[1] / 0.7, -1), atol=1e-6)


def test_token_bitmask_masks_exactly_the_cleared_bits():
    """Bit b of word w allows token 32 w + b (bit 31 included); vocabulary past the words is
    not allowed; a masked greedy row takes the best allowed token."""
    vocab = 70  # 3 words, the last partly past the vocabulary
    rng = np.random.default_rng(0)
    allowed = rng.random((4, 96)) < 0.3
    allowed[:, 31] = allowed[:, 63] = True  # the sign bit of words 0 and 1
    allowed[:, 66:] = False
    words = np.packbits(allowed, axis=1, bitorder="little").view(np.int32)
    logits = torch.randn(4, vocab)
    out = apply_token_bitmask(logits, words)
    assert torch.equal(torch.isfinite(out), torch.from_numpy(allowed[:, :vocab]))
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])
    narrow = apply_token_bitmask(torch.randn(1, 40), words[:1, :1])  # 32 bits for 40 tokens
    assert not torch.isfinite(narrow[0, 32:]).any()
    rows = [(SamplingParams(temperature=0), 0, 0, [], [], ())] * 4
    ids, _ = SAMPLER(logits, build_sampling_inputs(rows, words))
    assert ids.tolist() == out.argmax(dim=-1).tolist()
    assert all(allowed[r, i] for r, i in enumerate(ids.tolist()))
