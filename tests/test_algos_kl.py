"""KL estimators k1/k2/k3 at hand-computed points (Schulman's note; GRPO eq. 4)."""

import math

import pytest
import torch
from torch.testing import assert_close

from grpo_lab.algos import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3

LN2 = math.log(2.0)


def test_known_pairs():
    # token 0: pi = 0.5, pi_ref = 0.25 -> logp - logp_ref = ln 2, x = logp_ref - logp = -ln 2
    # token 1: pi = 0.25, pi_ref = 0.5 -> logp - logp_ref = -ln 2, x = +ln 2
    # token 2: equal -> every estimator is 0
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.3]], dtype=torch.float64))
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.3]], dtype=torch.float64))
    # k1 = logp - logp_ref = [ln2, -ln2, 0]
    assert_close(kl_k1(logp, ref), torch.tensor([[LN2, -LN2, 0.0]], dtype=torch.float64))
    # k2 = 0.5 (ln 2)^2 = 0.2402265 for both signs
    assert_close(kl_k2(logp, ref), torch.tensor([[0.5 * LN2**2, 0.5 * LN2**2, 0.0]], dtype=torch.float64))
    # k3 = e^x - x - 1: token 0: 0.5 + ln2 - 1 = 0.1931472; token 1: 2 - ln2 - 1 = 0.3068528
    expected_k3 = torch.tensor([[0.5 + LN2 - 1.0, 2.0 - LN2 - 1.0, 0.0]], dtype=torch.float64)
    assert_close(kl_k3(logp, ref), expected_k3)
    assert_close(
        expected_k3, torch.tensor([[0.1931472, 0.3068528, 0.0]], dtype=torch.float64), atol=1e-7, rtol=0
    )


def test_registry_dispatch():
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-2.0]])
    for name, fn in [("k1", kl_k1), ("k2", kl_k2), ("k3", kl_k3)]:
        assert_close(KL_ESTIMATORS.get(name)(logp, ref), fn(logp, ref))


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_unbiased_estimators_have_exact_expectation(name):
    # Enumerating the vocabulary instead of sampling: E_{y~p}[k(y)] = sum_v p_v k_v must equal
    # KL(p || q) exactly for k1 and k3 (sum_v p_v q_v/p_v = 1 kills k3's extra terms).
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), -1)
    logq = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), -1)
    kl = (logp.exp() * (logp - logq)).sum()
    est = (logp.exp() * KL_ESTIMATORS.get(name)(logp, logq)).sum()
    assert_close(est, kl)


def test_k3_clamps_log_ratio_instead_of_overflowing():
    # x = logp_ref - logp = 100 gives e^100 ~ 2.7e43;
    # clamped to 20: e^20 - 20 - 1.  x = -100 -> clamped -20: e^-20 + 20 - 1.
    logp = torch.tensor([[-100.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, -100.0]], dtype=torch.float64)
    expected = torch.tensor([[math.exp(20) - 21.0, math.exp(-20) + 19.0]], dtype=torch.float64)
    assert_close(kl_k3(logp, ref), expected)
    # without the clamp e^1000 is inf in float32
    assert torch.isfinite(kl_k3(torch.tensor([[-1000.0]]), torch.tensor([[0.0]]))).all()


def test_k3_is_nonnegative_and_k1_is_not():
    gen = torch.Generator().manual_seed(1)
    logp, ref = -torch.rand(4, 9, generator=gen) * 3, -torch.rand(4, 9, generator=gen) * 3
    assert (kl_k3(logp, ref) >= 0).all() and (kl_k2(logp, ref) >= 0).all()
    assert (kl_k1(logp, ref) < 0).any()


def test_off_policy_sequence_kl_recovers_the_exact_kl_from_the_reference_policys_samples():
    """Two one-token completions a, b; pi = (0.8, 0.2), pi_ref = mu = (0.5, 0.5); the rows are one sample of
    each, as mu weights them equally. Weights pi/mu = (1.6, 0.4) -> normalised (0.8, 0.2); d = (ln 1.6, ln 0.4);
    KL = 0.8 ln 1.6 + 0.2 ln 0.4 = 0.376003 - 0.183258 = 0.192745 = KL(pi || pi_ref) exactly; per token the
    same (one token each); ESS = 1 / (2 (0.8^2 + 0.2^2)) = 0.735294. A plain mean of d over mu's rows (what an
    on-policy estimate would read) gives (ln 1.6 + ln 0.4) / 2 = -0.223144 instead."""
    from grpo_lab.algos.kl import off_policy_sequence_kl, sequence_kl

    f64 = dict(dtype=torch.float64)
    logp = torch.log(torch.tensor([[0.8, 0.3], [0.2, 0.3]], **f64))     # second column is padding
    ref = torch.log(torch.tensor([[0.5, 0.9], [0.5, 0.9]], **f64))
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]], **f64)
    kl, per_token, ess = off_policy_sequence_kl(logp, ref, ref, mask)
    exact = 0.8 * math.log(1.6) + 0.2 * math.log(0.4)
    assert_close(kl, torch.tensor(exact, **f64))
    assert abs(exact - 0.192745) < 1e-6
    assert_close(per_token, torch.tensor(exact, **f64))
    assert_close(ess, torch.tensor(1 / (2 * 0.68), **f64))
    assert abs(float(sequence_kl(logp, ref, mask).mean()) - (-0.223144)) < 1e-6
    # Rows the policy itself sampled (mu = pi): every weight is 1/N, the on-policy mean, with ESS 1.
    kl, _, ess = off_policy_sequence_kl(logp, ref, logp, mask)
    assert_close(kl, sequence_kl(logp, ref, mask).mean())
    assert float(ess) == pytest.approx(1.0)


def test_a_step_on_an_offline_pool_logs_the_current_policys_kl_not_the_pools():
    """grpo_lab.train.reference_kl_metrics: rows from the start policy's pool (extras offline) are weighted by
    π_learner / π_sampler (the case above: KL 0.192745, ESS 0.735294); the same rows sampled by the policy
    itself (online) read the sampler's log-probs, which for the pool would say 0 (sampler = reference)."""
    from grpo_lab.learner.batch import TensorBatch
    from grpo_lab.train import reference_kl_metrics

    ref = torch.log(torch.tensor([[0.5, 0.9], [0.5, 0.9]]))
    tensors = {"learner_logprobs": torch.log(torch.tensor([[0.8, 0.3], [0.2, 0.3]])), "ref_logprobs": ref,
               "sampler_logprobs": ref.clone(), "response_mask": torch.tensor([[1, 0], [1, 0]])}
    offline = reference_kl_metrics(TensorBatch(dict(tensors), 1, {"offline": True}))
    assert offline["kl_ref/seq"] == pytest.approx(0.192745, abs=1e-5)
    assert offline["kl_ref/token"] == pytest.approx(0.192745, abs=1e-5)
    assert offline["kl_ref/ess"] == pytest.approx(0.735294, abs=1e-5)
    online = reference_kl_metrics(TensorBatch(dict(tensors), 1, {}))
    assert online == {"kl_ref/seq": 0.0, "kl_ref/token": 0.0}
