"""Controlled noise on the training reward (``reward.noise``), to measure how each algorithm bears it.

Every entry of ``REWARD_NOISE`` is a pure function::

    fn(clean [N] float, *, generator, <the settings it names>) -> (noisy [N], metrics)

called once per rollout on the scalar reward, after the reward functions and before any shaping,
advantage or pairing; the caller seeds ``generator`` from the rollout's own seed, so noise is
reproducible and survives a resume without state of its own. Evaluation never sees it: it scores
completions with the task's verifier, not with this reward.

    none        r                                              (the default; bit-identical to no noise)
    flip        1 − r with probability flip_prob               (a 1/0 reward only: class-conditional
                                                                 symmetric label noise, Natarajan et al.
                                                                 NeurIPS 2013; "flip" has no meaning for
                                                                 partial credit, so other values are refused)
    gaussian    r + std · ε,  ε ~ N(0, 1)                      (an unbiased but noisy scorer)
    judge_like  r + b_prompt + std · ε + length_bias · len/L   (a scorer with systematic errors: a bias
                                                                 b_prompt ~ N(0, prompt_bias_std) that is
                                                                 fixed per prompt text, and a preference for
                                                                 long answers, len/L the completion's share
                                                                 of rollout.max_new_tokens: "the judge likes
                                                                 long answers", arXiv 2503.20783 §3 asks what
                                                                 length bias does to GRPO)

A per-prompt bias is invisible to group-relative advantages (it shifts a whole group), while a critic
or a batch baseline has to learn it; the length term is not: it ranks long answers up inside a group.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_lab.registry import Registry

# binary_only: the entry is defined only for 1/0 rewards (refused for others, before training starts
# where the reward's registry entry says so, else at the first rollout).
REWARD_NOISE = Registry("reward noise", defaults={"binary_only": False})

_BINARY_ATOL = 1e-6


def binary_mask(x: Tensor) -> Tensor:
    """Bool [N]: the value is 0 or 1 (within float noise)."""
    return (x.abs() <= _BINARY_ATOL) | ((x - 1).abs() <= _BINARY_ATOL)


@REWARD_NOISE.register("none")
def no_noise(clean: Tensor, *, generator: torch.Generator) -> tuple[Tensor, dict]:
    """The reward as it is; draws nothing, so the run is bit-identical to one without noise."""
    return clean, {}


@REWARD_NOISE.register("flip", binary_only=True)
def flip(clean: Tensor, *, generator: torch.Generator, flip_prob: float) -> tuple[Tensor, dict]:
    """clean [N] in {0, 1} -> each value flipped (1 − r) independently with probability flip_prob."""
    ok = binary_mask(clean)
    if not bool(ok.all()):
        bad = clean[~ok][0].item()
        raise ValueError(f"reward.noise.kind=flip needs a 1/0 reward, got {bad:g}: use reward=correctness "
                         "(binary) or reward.noise.kind=gaussian for graded rewards")
    flipped = torch.rand(clean.shape, generator=generator) < flip_prob       # [N] bool
    noisy = torch.where(flipped, 1.0 - clean, clean)
    return noisy, {"noise_flipped_frac": float(flipped.float().mean()) if clean.numel() else 0.0}


@REWARD_NOISE.register("gaussian")
def gaussian(clean: Tensor, *, generator: torch.Generator, std: float) -> tuple[Tensor, dict]:
    """clean [N] -> clean + std · ε, ε ~ N(0, 1) i.i.d."""
    return clean + std * torch.randn(clean.shape, generator=generator, dtype=clean.dtype), {}


@REWARD_NOISE.register("judge_like")
def judge_like(clean: Tensor, *, generator: torch.Generator, prompt_keys: Tensor, lengths: Tensor,
               max_new_tokens: int, seed: int, prompt_bias_std: float, std: float,
               length_bias: float) -> tuple[Tensor, dict]:
    """clean [N] -> clean + b[prompt] + std · ε + length_bias · lengths / max_new_tokens.

    prompt_keys LongTensor [N]: a stable id of each sample's prompt text (the same prompt gets the
    same bias in every step: the bias is the judge's, not the draw's); b[k] ~ N(0, prompt_bias_std)
    is drawn from a generator seeded by (seed, k) alone. lengths [N]: completion tokens.
    """
    bias = torch.zeros_like(clean)
    if prompt_bias_std:
        for key in prompt_keys.unique().tolist():
            g = torch.Generator().manual_seed((seed * 1_000_003 + int(key)) % (2**63))
            bias[prompt_keys == key] = prompt_bias_std * torch.randn((), generator=g, dtype=clean.dtype)
    noise = std * torch.randn(clean.shape, generator=generator, dtype=clean.dtype)
    length_term = length_bias * lengths.to(clean.dtype) / max(int(max_new_tokens), 1)
    return clean + bias + noise + length_term, {"noise_length_term": float(length_term.mean()) if clean.numel() else 0.0}


def noise_metrics(clean: Tensor, noisy: Tensor) -> dict[str, float]:
    """What a step's noise did: the clean and noisy means and their Pearson correlation (1.0 when
    noisy = clean; 0.0 when either is constant but they differ)."""
    if clean.numel() == 0:
        return {}
    out = {"clean_mean": float(clean.mean()), "noisy_mean": float(noisy.mean())}
    if torch.equal(clean, noisy):
        out["noise_corr"] = 1.0
    else:
        c, n = clean - clean.mean(), noisy - noisy.mean()
        denom = (c.norm() * n.norm()).item()
        out["noise_corr"] = float((c * n).sum() / denom) if denom > 0 else 0.0
    return out


def flip_pairs(chosen: Tensor, rejected: Tensor, *, generator: torch.Generator,
               flip_prob: float) -> tuple[Tensor, Tensor, Tensor]:
    """Preference-label noise: each pair (chosen [P], rejected [P]) swapped with probability
    flip_prob, as a labeller who picks the wrong side at that rate (the noise model of cDPO and rDPO,
    arXiv 2403.00409). -> (chosen [P], rejected [P], flipped bool [P])."""
    flipped = torch.rand(chosen.shape, generator=generator) < flip_prob     # [P] bool
    return torch.where(flipped, rejected, chosen), torch.where(flipped, chosen, rejected), flipped
