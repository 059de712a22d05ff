"""Shared by tests/test_fsdp.py and its torchrun child (tests/fsdp_child.py): the same learner
settings and batches on both sides of the FSDP2-vs-single-process comparison."""

import torch
from omegaconf import OmegaConf

from grpo_lab.schema import AlgorithmConfig, LearnerConfig
from grpo_lab.learner.batch import collate
from grpo_lab.learner.learner import Learner
from grpo_lab.objectives import OBJECTIVES

# Two epochs × two minibatches of 5 and 4 rows, micro-batches of 2: the ranks' shards (3/2, 2/2 rows)
# run 2/1 and 1/1 micro-batches, so the zero-weight padding passes run; KL > 0 shards the reference.
SGD_SETTINGS = dict(micro_batch_size=2, epochs=2, minibatches=2, kl={"coef": 0.04}, entropy_coef=0.01,
                    aggregation="seq_mean_token_mean")
# Plain SGD at this rate: the change is -lr × the summed gradient (lr 1 over 4 steps diverges to 1e5).
SGD_LR = 0.1
ADAM_SETTINGS = dict(micro_batch_size=4, grad_clip=1.0)


def make_learner(model_dir, *, strategy="single", micro_batch_size=4, grad_clip=0.0,
                 skip_rows_without_gradient=False, shared_prompt_forward=False, device="cpu", dtype="fp32", **algo):
    algo_cfg = OmegaConf.merge(OmegaConf.structured(AlgorithmConfig), algo)
    learner_cfg = OmegaConf.merge(OmegaConf.structured(LearnerConfig),
                                  {"device": device, "dtype": dtype, "micro_batch_size": micro_batch_size,
                                   "grad_clip": grad_clip,
                                   "strategy": strategy, "total_steps": 10,
                                   "skip_rows_without_gradient": skip_rows_without_gradient,
                                   "shared_prompt_forward": shared_prompt_forward})
    return Learner(model_dir, objective=OBJECTIVES.get(algo_cfg.objective), learner_cfg=learner_cfg, algo_cfg=algo_cfg,
                   temperature=1.0, seed=0,
                   max_completion_len=6)


def toy_batch(seed=0, n=10):
    g = torch.Generator().manual_seed(seed)
    prompts = [[1] + torch.randint(4, 16, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    completions = [torch.randint(4, 16, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist() + [2]
                   for _ in range(n)]
    batch = collate(prompts, completions, 0, [[-1.5] * len(c) for c in completions])
    batch["group_ids"] = torch.arange(n) // 2
    batch["advantages"] = torch.randn(n, 1, generator=g).expand_as(batch["response_mask"]).clone()
    batch["loss_mask"] = batch["response_mask"]
    return batch


def grouped_batch(seed=0, groups=4, group_size=3):
    """A sampled step's layout: `groups` prompts of 1-5 tokens, each with `group_size` completions of
    1-6 tokens, rows in group order; per-row advantages and sampler logprobs as in toy_batch.
    Prompt 1 is prompt 0 with a token 0 (the pad id) in front, so only the padding tells them apart."""
    g = torch.Generator().manual_seed(seed)
    distinct = [[1] + torch.randint(4, 16, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g).tolist()
                for _ in range(groups)]
    distinct[1] = [0] + distinct[0]
    prompts = [p for p in distinct for _ in range(group_size)]
    completions = [torch.randint(4, 16, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist() + [2]
                   for _ in prompts]
    batch = collate(prompts, completions, 0, [[-1.5] * len(c) for c in completions])
    batch["group_ids"] = torch.arange(len(prompts)) // group_size
    batch["advantages"] = torch.randn(len(prompts), 1, generator=g).expand_as(batch["response_mask"]).clone()
    batch["loss_mask"] = batch["response_mask"]
    return batch


def batch_with_silent_rows(seed=6, n=12):
    """toy_batch's groups of 2 with groups 0 and 2 at all-zero advantages (their rewards agreed) and
    row 7 with no token left in its loss mask (DAPO's overlong filter): 5 rows that add nothing."""
    batch = toy_batch(seed=seed, n=n)
    batch["advantages"][[0, 1, 4, 5]] = 0.0
    batch["loss_mask"] = batch["response_mask"].clone()
    batch["loss_mask"][7] = 0.0
    return batch


def silent_batches() -> list:
    """A batch with 5 of 12 rows silent, then one with every row silent (nothing left to forward)."""
    agreed = batch_with_silent_rows(seed=7)
    agreed["advantages"].zero_()
    return [batch_with_silent_rows(), agreed]
