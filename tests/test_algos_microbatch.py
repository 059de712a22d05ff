"""Micro-batch invariance: splitting a minibatch into micro-batches (each padded to its own
length) and summing aggregate(policy_loss(micro), global counts) gives exactly the full-batch
loss and gradient, for every policy loss x every aggregation mode."""

import functools
import itertools

import pytest
import torch
from torch.testing import assert_close

from grpo_lab.algos import AGGREGATIONS, POLICY_LOSSES, aggregate
from grpo_lab.schema import AlgorithmConfig, as_dict

D = torch.float64
LENGTHS = torch.tensor([7, 2, 5, 1, 4, 6])  # unequal lengths
T = 9  # padded beyond the longest sequence, as a full batch usually is
SPLITS = [(0, 2), (2, 3), (3, 6)]  # unequal micro-batch sizes


def _batch():
    gen = torch.Generator().manual_seed(0)
    n = LENGTHS.numel()
    mask = (torch.arange(T)[None, :] < LENGTHS[:, None]).long()
    params = (-torch.rand(n, T, generator=gen, dtype=D) * 2).requires_grad_()
    old = params.detach() + 0.4 * torch.randn(n, T, generator=gen, dtype=D)  # some ratios clip
    adv = torch.randn(n, T, generator=gen, dtype=D)
    is_w = torch.rand(n, T, generator=gen, dtype=D) + 0.5
    return params, old, adv, is_w, mask


@pytest.mark.parametrize(
    ("loss_name", "mode"), list(itertools.product(POLICY_LOSSES.names(), AGGREGATIONS.names()))
)
def test_microbatch_split_matches_full_batch(loss_name, mode):
    params, old, adv, is_w, mask = _batch()
    loss_fn = functools.partial(POLICY_LOSSES.call, loss_name)  # each loss takes the settings it reads
    # every loss's own settings at the recipes' defaults (cispo_clip_high, sapo_tau_pos, ...), then the clips
    kwargs = {**as_dict(AlgorithmConfig()), "clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}
    num_tokens = mask.sum()
    num_seqs = (mask.sum(-1) > 0).sum()
    max_len = 16  # e.g. the generation budget; must be the same for all micro-batches

    # garbage at padding: micro-batches trim it away, the full batch must ignore it
    logp_full = torch.where(mask.bool(), params, 1.0e4)
    loss_mat, _ = loss_fn(logp_full, old, adv, mask, is_weights=is_w, **kwargs)
    full = aggregate(loss_mat, mask, mode, max_len=max_len)
    (g_full,) = torch.autograd.grad(full, params)

    total = torch.zeros((), dtype=D)
    for lo, hi in SPLITS:
        t_mb = int(LENGTHS[lo:hi].max())  # each micro-batch padded only to its own longest
        sl = (slice(lo, hi), slice(0, t_mb))
        mb_loss, _ = loss_fn(params[sl], old[sl], adv[sl], mask[sl], is_weights=is_w[sl], **kwargs)
        total = total + aggregate(
            mb_loss, mask[sl], mode, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len
        )
    (g_micro,) = torch.autograd.grad(total, params)

    assert_close(total, full)
    assert_close(g_micro, g_full)
    assert g_full.abs().sum() > 0  # the test would notice a zero gradient


def test_local_defaults_would_be_wrong():
    # Guard against a vacuous test: averaging per-micro-batch token means is NOT the full token mean
    # when micro-batches hold different numbers of tokens.
    params, old, adv, _, mask = _batch()
    loss_fn = POLICY_LOSSES.get("clipped_surrogate")
    loss_mat, _ = loss_fn(params, old, adv, mask, clip_low=0.2, clip_high=0.28)
    full = aggregate(loss_mat, mask, "token_mean")
    naive = sum(aggregate(loss_mat[lo:hi], mask[lo:hi], "token_mean") for lo, hi in SPLITS) / len(SPLITS)
    assert not torch.allclose(naive, full)
