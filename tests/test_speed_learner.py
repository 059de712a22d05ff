"""The learner's excess removed without changing any result: each speed-up is compared
with the computation it replaced, on the tiny model (losses, gradients, updates and metrics)."""

import copy

import pytest
import torch
from omegaconf import OmegaConf

from grpo_lab.schema import AlgorithmConfig, LearnerConfig
from grpo_lab.learner.batch import collate, completion_logits, completion_stats, prompt_groups, token_logprobs
from grpo_lab.learner.learner import Learner
from grpo_lab.objectives import OBJECTIVES
from grpo_lab.models import MODEL_BUILDERS

import fsdp_common  # tests/ is on sys.path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return MODEL_BUILDERS.get("tiny_llama")(tmp_path_factory.mktemp("m") / "model", alphabet="0123456789+-=", seed=0)


def make_learner(model_dir, learner=None, **algo):
    algo_cfg = OmegaConf.merge(OmegaConf.structured(AlgorithmConfig), algo)
    learner_cfg = OmegaConf.merge(OmegaConf.structured(LearnerConfig),
                                  {"device": "cpu", "micro_batch_size": 4, "grad_clip": 0.0, **(learner or {})})
    out = Learner(model_dir, objective=OBJECTIVES.get(algo_cfg.objective), learner_cfg=learner_cfg, algo_cfg=algo_cfg,
                  temperature=0.7, seed=0,
                  max_completion_len=6)
    out.optimizer = torch.optim.SGD([p for p in out.policy.parameters() if p.requires_grad], lr=0.5)
    return out


def collate_row_by_row(prompts, completions, pad_id, sampler_logprobs):
    """The padding loop `collate` replaced (one Python assignment per row), kept as the reference."""
    n, P, T = len(prompts), max(map(len, prompts)), max(1, max(map(len, completions)))
    input_ids = torch.full((n, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((n, P + T), dtype=torch.long)
    response_mask = torch.zeros((n, T))
    old = torch.zeros((n, T))
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, P - len(p):P] = torch.tensor(p)
        attention[i, P - len(p):P] = 1
        if c:
            input_ids[i, P:P + len(c)] = torch.tensor(c)
            attention[i, P:P + len(c)] = 1
            response_mask[i, :len(c)] = 1.0
            old[i, :len(c)] = torch.tensor(sampler_logprobs[i])
    return {"input_ids": input_ids, "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "completion_ids": input_ids[:, P:].clone(), "response_mask": response_mask, "sampler_logprobs": old}


def test_vectorised_collate_equals_row_by_row_padding():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 50, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(13)]
    completions = [torch.randint(1, 50, (int(torch.randint(0, 7, (1,), generator=g)),), generator=g).tolist() for _ in range(13)]
    completions[3] = []                                                    # an empty completion
    logprobs = [(-torch.rand(len(c), generator=g)).tolist() for c in completions]
    batch, ref = collate(prompts, completions, 0, logprobs), collate_row_by_row(prompts, completions, 0, logprobs)
    assert set(batch.tensors) == set(ref)
    for k, v in ref.items():
        assert batch[k].dtype == v.dtype and torch.equal(batch[k], v), k


def test_completion_logits_skip_the_prompt_positions(model_dir):
    """logits_to_keep = T + 1 gives the same [N, T, V] as the full forward sliced at P − 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    batch = fsdp_common.toy_batch(seed=2, n=9)
    P, T = batch.prompt_width, batch["completion_ids"].shape[1]
    with torch.no_grad():
        full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=batch["position_ids"], use_cache=False).logits[:, P - 1:P - 1 + T] / 0.7
        torch.testing.assert_close(completion_logits(model, batch, 0.7), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 7])
def test_entropy_as_a_metric_is_off_the_graph_and_changes_no_gradient(model_dir, chunk):
    from transformers import AutoModelForCausalLM

    batch = fsdp_common.toy_batch(seed=3, n=6)
    grads = []
    for entropy_grad in (True, False):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        logp, ent = completion_stats(model, batch, 0.7, chunk_tokens=chunk, entropy=True, entropy_grad=entropy_grad)
        assert ent.requires_grad == entropy_grad and logp.requires_grad
        (logp * batch["advantages"]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        values = (logp.detach(), ent.detach())
        if entropy_grad:
            first = values
    for a, b in zip(first, values):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0)


def count_policy_forwards(learner) -> list:
    calls = []
    decoder = (learner.policy.get_base_model() if learner.lora else learner.policy).get_decoder()
    decoder.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


def run_step(learner, batch):
    before = {n: p.detach().clone() for n, p in learner.policy.named_parameters()}
    metrics = {**learner.score(batch), **learner.update(batch)}
    delta = {n: p.detach() - before[n] for n, p in learner.policy.named_parameters()}
    return metrics, delta


@pytest.mark.parametrize("learner_cfg,algo", [
    ({}, {}),                                                                   # the default GRPO step
    ({"logits_chunk_tokens": 5, "max_tokens_per_micro_batch": 40}, {"kl": {"coef": 0.05}}),  # reference still scored
    ({"lora": {"rank": 4, "alpha": 8.0}, "dtype": "bf16"}, {"entropy_coef": 0.01}),
])
def test_the_update_without_a_scoring_forward_equals_the_update_with_it(model_dir, learner_cfg, algo):
    """One step per batch: the update's own forward gives π_learner, so the scoring forward is
    skipped; losses, the update, every metric (the engine-mismatch ones included) are unchanged."""
    fast, scored = make_learner(model_dir, learner_cfg, **algo), make_learner(model_dir, learner_cfg, **algo)
    scored.learner_logprobs_from_update = lambda batch: False                   # the old path: always score
    batch = fsdp_common.toy_batch(seed=4, n=10)
    forwards = {id(fast): count_policy_forwards(fast), id(scored): count_policy_forwards(scored)}
    m_fast, d_fast = run_step(fast, copy.deepcopy(batch))
    m_scored, d_scored = run_step(scored, copy.deepcopy(batch))
    assert fast.learner_logprobs_from_update(batch)
    uses_ref = fast.ref is not None
    micro = len(forwards[id(fast)]) - (len(forwards[id(fast)]) // 2 if uses_ref else 0)
    # The scored learner ran its policy forward once more per scoring micro-batch.
    assert len(forwards[id(scored)]) > len(forwards[id(fast)]) >= micro > 0
    assert set(m_fast) == set(m_scored) and "rollout/logprob_abs_diff_max" in m_fast
    tol = 2e-2 if learner_cfg.get("dtype") == "bf16" else 1e-5   # bf16: different row groupings round differently
    for k in m_scored:
        assert m_fast[k] == pytest.approx(m_scored[k], rel=tol, abs=tol), k
    for name in d_scored:
        torch.testing.assert_close(d_fast[name], d_scored[name], rtol=1e-4, atol=1e-6)
    assert max(d.abs().max() for d in d_fast.values()) > 0


@pytest.mark.parametrize("algo", [{"epochs": 2}, {"minibatches": 2}, {"rollout_correction": {"level": "token"}}])
def test_the_scoring_forward_runs_when_the_update_cannot_replace_it(model_dir, algo):
    learner = make_learner(model_dir, **algo)
    batch = fsdp_common.toy_batch(seed=5, n=8)
    assert not learner.learner_logprobs_from_update(batch)
    metrics = learner.score(batch)
    assert "learner_logprobs" in batch and "rollout/logprob_abs_diff_mean" in metrics
    assert "rollout/logprob_abs_diff_mean" not in learner.update(batch)


def test_dropout_keeps_the_scoring_forward(model_dir):
    learner = make_learner(model_dir, {"lora": {"rank": 4, "alpha": 8.0, "dropout": 0.1}})
    assert learner.stochastic_forward and not learner.learner_logprobs_from_update(fsdp_common.toy_batch())


# ---------------------------------------------------------------- rows without gradient
def count_forwarded_rows(learner) -> list:
    rows = []
    decoder = (learner.policy.get_base_model() if learner.lora else learner.policy).get_decoder()
    decoder.register_forward_pre_hook(lambda module, args, kwargs: rows.append(len(kwargs["input_ids"])),
                                      with_kwargs=True)
    return rows


def test_rows_without_gradient_by_hand():
    """Which rows add exactly nothing, per setting (PolicyGradient.rows_without_gradient)."""
    pg = OBJECTIVES.get("policy_gradient")
    algo = lambda **kw: OmegaConf.merge(OmegaConf.structured(AlgorithmConfig), kw)
    batch = fsdp_common.batch_with_silent_rows()
    silent = lambda a, b=batch: pg.rows_without_gradient(b, a).nonzero().squeeze(-1).tolist()
    assert silent(algo()) == [0, 1, 4, 5, 7]
    assert silent(algo(policy_loss="gspo", aggregation="seq_mean_token_mean")) == [0, 1, 4, 5, 7]
    assert silent(algo(kl={"coef": 0.1, "placement": "reward"})) == [0, 1, 4, 5, 7]   # KL already in A
    # A term other than A·(...) acts on every loss token: only the empty-mask row adds nothing.
    assert silent(algo(entropy_coef=0.01)) == [7]
    assert silent(algo(kl={"coef": 0.1, "placement": "loss"})) == [7]
    # The best-of-group anchor trains on row 4 (response mask, not loss mask) whatever its advantage.
    anchored = copy.deepcopy(batch)
    anchored["anchor_weight"] = torch.zeros(len(batch))
    anchored["anchor_weight"][[4, 7]] = 1.0
    assert silent(algo(), anchored) == [0, 1, 5]
    # An answer the rollout correction masked whole (weights 0: row 9) adds nothing, unless another term acts.
    masked = copy.deepcopy(batch)
    masked["is_weights"] = torch.ones_like(batch["loss_mask"])
    masked["is_weights"][9] = 0.0
    assert silent(algo(), masked) == [0, 1, 4, 5, 7, 9]
    assert silent(algo(entropy_coef=0.01), masked) == [7]
    # Preference objectives claim none.
    assert not OBJECTIVES.get("preference").rows_without_gradient(batch, algo()).any()


@pytest.mark.parametrize("learner_cfg,algo", [
    ({}, {}),                                                                             # default GRPO
    ({"max_tokens_per_micro_batch": 40}, {"policy_loss": "gspo", "aggregation": "seq_mean_token_mean"}),
    ({}, {"aggregation": "seq_mean_token_sum_norm", "epochs": 2, "minibatches": 2}),     # Dr.GRPO, μ > 1
    ({"lora": {"rank": 4, "alpha": 8.0}}, {"kl": {"coef": 0.05, "placement": "reward"}, "sft_anchor_coef": 0.5}),
])
def test_skipping_rows_without_gradient_leaves_the_update_unchanged(model_dir, learner_cfg, algo):
    """The same parameter change (SGD: minus the summed gradient) from fewer rows forwarded; the
    silent share is reported either way, and the engine-mismatch metrics come from the rows trained on."""
    learners = {skip: make_learner(model_dir, {**learner_cfg, "skip_rows_without_gradient": skip}, **algo)
                for skip in (False, True)}
    rows = {skip: count_forwarded_rows(learner) for skip, learner in learners.items()}
    results = {}
    for skip, learner in learners.items():
        batch = fsdp_common.batch_with_silent_rows()
        if algo.get("sft_anchor_coef"):          # row 4 is its group's best: trained although A = 0
            batch["anchor_weight"] = torch.zeros(len(batch))
            batch["anchor_weight"][[4, 9]] = 1.0
            batch.extras["anchor_coef"] = algo["sft_anchor_coef"]
        results[skip] = run_step(learner, batch)
    (m_all, d_all), (m_skip, d_skip) = results[False], results[True]
    silent = 4 if algo.get("sft_anchor_coef") else 5
    epochs = algo.get("epochs", 1)
    assert sum(rows[False]) - sum(rows[True]) == silent * epochs     # the scoring forwards are the same
    assert m_skip["actor/rows_without_gradient_frac"] == m_all["actor/rows_without_gradient_frac"] == pytest.approx(
        silent / 12)
    for name in d_all:
        torch.testing.assert_close(d_skip[name], d_all[name], rtol=1e-4, atol=1e-6)
    assert max(d.abs().max() for d in d_skip.values()) > 0
    if epochs == 1:
        assert "rollout/logprob_abs_diff_mean" in m_skip


def test_a_minibatch_with_every_row_silent_still_steps_adamw(model_dir):
    """Nothing to forward, but AdamW's moments move the weights at zero gradient: one zero-weight
    pass keeps the step, so the weights move exactly as the unskipped learner's do."""
    learners = [make_learner(model_dir) for _ in range(2)]
    rows = [count_forwarded_rows(learner) for learner in learners]
    deltas = []
    for learner, skip, forwarded in zip(learners, (False, True), rows):
        learner.optimizer = torch.optim.AdamW(learner.policy.parameters(), lr=1e-2)
        run_step(learner, fsdp_common.batch_with_silent_rows())    # the same first step: Adam's moments are set
        learner.cfg.skip_rows_without_gradient = skip
        agreed = fsdp_common.batch_with_silent_rows()
        agreed["advantages"].zero_()                    # then every group's rewards agree
        forwarded.clear()
        metrics, delta = run_step(learner, agreed)
        deltas.append(delta)
        assert metrics["actor/rows_without_gradient_frac"] == 1.0
    assert sum(rows[1]) == 1 < sum(rows[0])             # the one zero-weight pass
    for name in deltas[0]:
        torch.testing.assert_close(deltas[1][name], deltas[0][name], rtol=0, atol=0)
    assert max(d.abs().max() for d in deltas[1].values()) > 0


# ------------------------------------------------------- learner.shared_prompt_forward (arXiv 2506.05433)
def test_prompt_groups_by_hand():
    """Rows 0, 1, 4 share prompt [1, 5]; [5] and [0, 5] (pad id 0 as a real token) look alike once
    left-padded to width 2 but differ in their masks, so they stay apart."""
    batch = collate([[1, 5], [1, 5], [5], [0, 5], [1, 5]], [[2]] * 5, 0)
    first, inverse = prompt_groups(batch)
    groups = sorted([i for i in range(5) if inverse[i] == u] for u in range(len(first)))
    assert groups == [[0, 1, 4], [2], [3]]
    assert all(int(first[inverse[i]]) == group[0] for group in groups for i in group)


def count_embedded_positions(model) -> list:
    positions = []
    model.get_input_embeddings().register_forward_pre_hook(lambda module, args: positions.append(args[0].numel()))
    return positions


def unpadded_grouped_batch():
    """Every prompt 3 tokens, every completion 3: no padding anywhere (HF's mask shortcuts)."""
    batch = collate([[1, 4, 5]] * 3 + [[1, 6, 7]] * 3, [[4, 5, 2], [6, 7, 2], [8, 9, 2]] * 2, 0,
                    [[-1.5] * 3] * 6)
    batch["advantages"] = torch.linspace(-1, 1, 6)[:, None].expand_as(batch["response_mask"]).clone()
    return batch


@pytest.mark.parametrize("chunk,lora,layout", [(None, False, "ragged"), (7, False, "ragged"), (None, True, "ragged"),
                                               (None, False, "unpadded")])
def test_shared_prompt_forward_gives_the_same_logprobs_entropy_and_gradients(model_dir, chunk, lora, layout):
    """Each distinct prompt through the model once, its rows' completions on its cached keys/values:
    the same logprobs, entropy and gradients (an entropy bonus on the graph too) from U·P + N·T
    embedded positions instead of N·(P + T)."""
    from transformers import AutoModelForCausalLM

    from grpo_lab.learner.trainable import apply_lora

    batch = fsdp_common.grouped_batch(seed=1) if layout == "ragged" else unpadded_grouped_batch()
    (N, T), P = batch["completion_ids"].shape, batch.prompt_width
    U = len(prompt_groups(batch)[0])
    assert U == N // 3
    out, positions = {}, {}
    for shared in (False, True):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        if lora:
            torch.manual_seed(0)          # LoRA's A is drawn from the global generator
            model = apply_lora(model, OmegaConf.create({"rank": 4, "alpha": 8.0, "dropout": 0.0,
                                                        "target_modules": ["q_proj", "v_proj", "down_proj"]}))
            g = torch.Generator().manual_seed(0)
            for name, p in model.named_parameters():
                if "lora_B" in name:   # B = 0 at start would leave A without a gradient
                    p.data.copy_(0.1 * torch.randn(p.shape, generator=g))
        positions[shared] = count_embedded_positions(model)
        logp, ent = completion_stats(model, batch, 0.7, chunk_tokens=chunk, entropy=True, entropy_grad=True,
                                     shared_prompts=shared)
        mask = batch["response_mask"]
        ((logp * batch["advantages"] + 0.01 * ent) * mask).sum().backward()
        out[shared] = (logp.detach() * mask, ent.detach() * mask,
                       {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (lp0, e0, g0), (lp1, e1, g1) = out[False], out[True]
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)
    torch.testing.assert_close(e1, e0, rtol=0, atol=1e-5)
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-5, msg=name)
    assert sum(positions[False]) == N * (P + T)
    assert sum(positions[True]) == U * P + N * T


@pytest.mark.parametrize("learner_cfg,algo", [
    ({}, {}),                                                                   # the default GRPO step
    ({"skip_rows_without_gradient": True, "logits_chunk_tokens": 5, "max_tokens_per_micro_batch": 40},
     {"kl": {"coef": 0.05}, "minibatches": 2}),                                 # the reference shares too
    ({"lora": {"rank": 4, "alpha": 8.0}, "micro_batch_size": 5}, {"epochs": 2, "entropy_coef": 0.01}),
])
def test_the_update_with_shared_prompt_forwards_equals_the_update_without(model_dir, learner_cfg, algo):
    """Minibatches are random draws of rows; the learner regroups them by prompt before micro-batching.
    The parameter change (SGD), the gradient norm and the engine-mismatch metrics are the unshared
    learner's, from fewer embedded positions."""
    runs = {}
    for shared in (False, True):
        learner = make_learner(model_dir, {**learner_cfg, "shared_prompt_forward": shared}, **algo)
        positions = count_embedded_positions(learner.policy.get_base_model() if learner.lora else learner.policy)
        batch = fsdp_common.grouped_batch(seed=5, groups=4, group_size=4)
        batch["advantages"][:4] = 0.0                  # one group whose rewards agreed (silent when skipping)
        runs[shared] = (*run_step(learner, batch), sum(positions))
    (m0, d0, n0), (m1, d1, n1) = runs[False], runs[True]
    for name in d0:
        torch.testing.assert_close(d1[name], d0[name], rtol=1e-4, atol=1e-6, msg=name)
    assert max(d.abs().max() for d in d1.values()) > 0
    for k in [k for k in m0 if k.startswith("rollout/") or k == "actor/grad_norm"]:
        assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-6), k
    assert n1 < n0


@pytest.mark.parametrize("shared", [False, True])
def test_the_eager_attention_kernel_gives_the_default_kernels_update(model_dir, shared):
    """learner.attn_implementation=eager (faster for short rows on CPU) is the same computation as the
    model's default kernel (sdpa): the same parameter change and gradient norm, padded rows and the
    shared-prompt forward's cached keys included."""
    runs = {}
    for attn in (None, "eager"):
        learner = make_learner(model_dir, {"attn_implementation": attn, "shared_prompt_forward": shared})
        assert learner.policy.config._attn_implementation == (attn or "sdpa")
        runs[attn] = run_step(learner, fsdp_common.grouped_batch(seed=5, groups=4, group_size=4))
    (m0, d0), (m1, d1) = runs[None], runs["eager"]
    for name in d0:
        torch.testing.assert_close(d1[name], d0[name], rtol=1e-4, atol=1e-6, msg=name)
    assert max(d.abs().max() for d in d1.values()) > 0
    assert m1["actor/grad_norm"] == pytest.approx(m0["actor/grad_norm"], rel=1e-4)


def test_shared_prompt_forward_refuses_gradient_checkpointing():
    """Under checkpointing HF drops the KV cache the completions need: refused at validation, with the fix."""
    import re

    from test_config import make
    from grpo_lab.config import validate
    from grpo_lab.schema import ConfigError

    with pytest.raises(ConfigError, match=re.escape("learner.shared_prompt_forward=true needs the model's KV cache")):
        validate(make(["learner.shared_prompt_forward=true", "learner.gradient_checkpointing=true"]))
