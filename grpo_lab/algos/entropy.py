"""Token entropy of the policy's next-token distribution, for the entropy bonus and logging."""

from __future__ import annotations

import torch
from torch import Tensor


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy H = -sum_v p_v log p_v of softmax(logits) over the vocabulary, per position.

        H = logsumexp(z) - sum_v softmax(z)_v z_v

    which avoids log(p) of tiny probabilities (verl's ``entropy_from_logits`` uses the same form).
    Logits of -inf (banned tokens) are allowed: they get p = 0 and contribute 0. Differentiable.
    Computed in the logits' dtype; upcast bf16 logits first if you need more than logging accuracy.

    Shapes: logits [N, T, V] (any leading dims) -> entropy [N, T].
    """
    # Replace -inf by the most negative finite value: same softmax, but 0 * z stays 0, not NaN.
    z = logits.clamp(min=torch.finfo(logits.dtype).min)
    probs = torch.softmax(z, dim=-1)  # [N, T, V]
    return torch.logsumexp(z, dim=-1) - (probs * z).sum(-1)
