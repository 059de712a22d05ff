"""Loss aggregation: a per-token loss matrix [n, T] -> one scalar.

Every mode is ``fn(loss_mat [n, T], response_mask [n, T], *, num_tokens=None, num_seqs=None,
max_len=None) -> scalar``; call them through :func:`aggregate`. With l = loss, m = mask:

    token_mean               sum_{i,t} l*m / num_tokens                      (DAPO, arXiv 2503.14476 sec. 3.3)
    seq_mean_token_mean      sum_i [sum_t l*m / len_i] / num_seqs            (GRPO eq. 3, arXiv 2402.03300)
    seq_mean_token_sum       sum_i  sum_t l*m / num_seqs
    seq_mean_token_sum_norm  sum_{i,t} l*m / (num_seqs * max_len)            (Dr.GRPO, 2503.20783)

Micro-batching: every mode is a sum over sequences divided by a normaliser that does not depend on
the micro-batch (num_tokens, num_seqs, max_len). So when a minibatch is split into micro-batches
for gradient accumulation, pass the minibatch-wide counts to each call and *sum* the results (no
division by the number of micro-batches): the sum equals the full-minibatch value and gradient
exactly. The defaults (the local counts) are right only when the call sees the whole minibatch.
For ``seq_mean_token_sum_norm`` pass max_len too: each micro-batch may be padded to a different T.

Conventions (our choice, stated here since papers do not need one): ``num_seqs`` defaults to the
number of rows with at least one real token, so all-padding rows (added to even out micro-batch
sizes) do not dilute the mean; a row with no real token contributes 0, never NaN; a zero count
is treated as 1 (the loss is then 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._utils import as_bool_mask
from grpo_lab.registry import Registry

AGGREGATIONS = Registry("loss aggregation")


def _masked_rows(loss_mat: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """-> (per-sequence sums of l*m [n], per-sequence real-token counts [n]) in loss dtype."""
    if loss_mat.shape != response_mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat {tuple(loss_mat.shape)} and response_mask {tuple(response_mask.shape)} "
            "must both be [n, T]"
        )
    mask = as_bool_mask(response_mask)
    zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    row_sums = torch.where(mask, loss_mat, zero).sum(-1)  # [n]
    lengths = mask.sum(-1).to(loss_mat.dtype)  # [n]
    return row_sums, lengths


def _denominator(count: float | Tensor | None, default: Tensor) -> Tensor:
    """The normaliser: the given (global) count or the local default, floored at 1 to avoid 0/0."""
    value = default if count is None else torch.as_tensor(count, dtype=default.dtype, device=default.device)
    return value.clamp(min=1)


@AGGREGATIONS.register("token_mean")
def token_mean(
    loss_mat: Tensor,
    response_mask: Tensor,
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """sum_{i,t} l*m / num_tokens: every token weighs the same (DAPO, arXiv 2503.14476 sec. 3.3).

    A sequence's weight grows with its length, so long degenerate answers are penalised in full.

    Shapes: loss_mat, response_mask [n, T] -> scalar. num_tokens defaults to mask.sum().
    """
    row_sums, lengths = _masked_rows(loss_mat, response_mask)
    return row_sums.sum() / _denominator(num_tokens, lengths.sum())


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(
    loss_mat: Tensor,
    response_mask: Tensor,
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """sum_i [sum_t l*m / len_i] / num_seqs: mean over tokens, then over sequences (GRPO eq. 3).

    Shapes: loss_mat, response_mask [n, T] -> scalar. num_seqs defaults to the number of rows with
    a real token.
    """
    row_sums, lengths = _masked_rows(loss_mat, response_mask)
    per_seq = row_sums / lengths.clamp(min=1)  # [n]; 0 for an all-padding row
    return per_seq.sum() / _denominator(num_seqs, (lengths > 0).sum().to(per_seq.dtype))


@AGGREGATIONS.register("seq_mean_token_sum")
def seq_mean_token_sum(
    loss_mat: Tensor,
    response_mask: Tensor,
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """sum_i sum_t l*m / num_seqs: sum over tokens, mean over sequences.

    Shapes: loss_mat, response_mask [n, T] -> scalar. num_seqs default as above.
    """
    row_sums, lengths = _masked_rows(loss_mat, response_mask)
    return row_sums.sum() / _denominator(num_seqs, (lengths > 0).sum().to(row_sums.dtype))


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    loss_mat: Tensor,
    response_mask: Tensor,
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """sum_{i,t} l*m / (num_seqs * max_len): Dr.GRPO's constant normaliser (arXiv 2503.20783).

    Dividing by the same constant for every sequence removes GRPO's length bias (1/len_i favours
    short correct and long wrong answers). Dr.GRPO uses the generation budget as max_len; it
    defaults to T here, so pass the budget (or at least one value for all micro-batches).

    Shapes: loss_mat, response_mask [n, T] -> scalar.
    """
    row_sums, lengths = _masked_rows(loss_mat, response_mask)
    seqs = _denominator(num_seqs, (lengths > 0).sum().to(row_sums.dtype))
    length = torch.as_tensor(
        loss_mat.shape[-1] if max_len is None else max_len, dtype=row_sums.dtype, device=row_sums.device
    ).clamp(min=1)
    return row_sums.sum() / (seqs * length)


def aggregate(
    loss_mat: Tensor,
    response_mask: Tensor,
    mode: str,
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Aggregate a per-token loss [n, T] into a scalar with the registered ``mode``.

    Pass minibatch-wide ``num_tokens`` / ``num_seqs`` (and ``max_len``) when ``loss_mat`` is one
    micro-batch of a larger minibatch, and sum the micro-batch results (see the module docstring).
    Unknown modes raise an error listing the valid ones.
    """
    fn = AGGREGATIONS.get(mode)
    return fn(loss_mat, response_mask, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)
