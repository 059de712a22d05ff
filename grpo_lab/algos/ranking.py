"""Reward-model losses: a scalar score per (prompt, completion), trained to rank what a labeller preferred.

One registry, one signature::

    RANKING_LOSSES[name](scores [N, k], mask [N, k], *, margin [N] | None = None) -> (loss, metrics)

Each row holds the scores of k completions of one prompt **in the labeller's order, best first**;
`mask` marks the real entries (a row may rank fewer than k). A preference pair is the k = 2 case
(column 0 chosen, column 1 rejected).

* ``bradley_terry`` (Bradley & Terry 1952; the reward-model loss of InstructGPT, arXiv 2203.02155,
  eq. 1): each adjacent pair of a row, ``−log σ(s_w − s_l − m)``; with a margin m per row (Llama 2,
  arXiv 2307.09288, eq. 2: larger for clearer preferences), 0 without. For k = 2 this is the pair loss.
* ``plackett_luce`` (Plackett 1975; Luce 1959): the likelihood of the whole ranking, a best-first
  sequence of softmax choices among the items not yet chosen:
  ``−Σ_{i<n} log( exp(s_i) / Σ_{j ≥ i} exp(s_j) )`` over a row's n real items, mean over rows. For
  k = 2 it equals Bradley–Terry without a margin.

Metrics: ``accuracy`` (fraction of adjacent pairs ranked in the labeller's order: s_w > s_l) and
``margin`` (mean s_w − s_l over those pairs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from grpo_lab.registry import Registry

RANKING_LOSSES = Registry("ranking loss")


def adjacent_pair_mask(mask: Tensor) -> Tensor:
    """Bool [N, k-1]: neighbours i, i+1 of a row both real (the pairs the losses and metrics average over)."""
    return (mask[:, :-1] > 0) & (mask[:, 1:] > 0)


def _adjacent_pairs(scores: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(better [P], worse [P], row of each [P]) for every pair of neighbours i, i+1 both real."""
    both = adjacent_pair_mask(mask)                                          # [N, k-1]
    rows = torch.arange(scores.shape[0], device=scores.device)[:, None].expand_as(both)
    return scores[:, :-1][both], scores[:, 1:][both], rows[both]


def _pair_metrics(better: Tensor, worse: Tensor) -> dict[str, Tensor]:
    diff = (better - worse).detach()
    return {"accuracy": (diff > 0).float().mean() if len(diff) else diff.new_zeros(()),
            "margin": diff.mean() if len(diff) else diff.new_zeros(())}


# Fact `averages_over`: what the loss is a mean over (adjacent pairs of each row, or rows), so a batch split
# into micro-batches weights each by its share of them and the summed gradient is the whole batch's.
@RANKING_LOSSES.register("bradley_terry", averages_over="pairs")
def bradley_terry_loss(scores: Tensor, mask: Tensor, *, margin: Tensor | None = None) -> tuple[Tensor, dict]:
    """Mean over adjacent ranked pairs of −log σ(s_w − s_l − m); m = margin[row] (0 when None)."""
    better, worse, rows = _adjacent_pairs(scores, mask)
    shift = margin[rows] if margin is not None else 0.0
    loss = -F.logsigmoid(better - worse - shift).mean()
    return loss, _pair_metrics(better, worse)


@RANKING_LOSSES.register("plackett_luce", averages_over="rows")
def plackett_luce_loss(scores: Tensor, mask: Tensor, *, margin: Tensor | None = None) -> tuple[Tensor, dict]:
    """Mean over rows of the negative log-likelihood of the row's ranking (module docstring). `margin`
    is a pairwise notion and is refused here."""
    if margin is not None:
        raise ValueError("plackett_luce ranks whole lists and takes no margin; use bradley_terry for margins")
    real = mask > 0                                                          # [N, k]
    # Padding ranks below everything (a finite floor: -inf would make the tails' gradients NaN).
    masked = scores.masked_fill(~real, torch.finfo(scores.dtype).min / 2)
    # log Σ_{j ≥ i} exp(s_j): a reversed cumulative logsumexp over each row.
    tail = torch.logcumsumexp(masked.flip(-1), dim=-1).flip(-1)              # [N, k]
    last = real & ~torch.cat([real[:, 1:], torch.zeros_like(real[:, :1])], dim=-1)   # the final choice is certain
    terms = torch.where(real & ~last, scores - tail, torch.zeros_like(scores))
    loss = -terms.sum(-1).mean()
    better, worse, _ = _adjacent_pairs(scores, mask)
    return loss, _pair_metrics(better, worse)
