"""Run by tests/test_fsdp.py under `torchrun --nproc_per_node 2`: the FSDP2 learner's side of the
equivalence and checkpoint tests. Writes its results into OUT (argv[2]) for the test to compare with
a single-process learner. argv: model_dir out_dir."""

import sys
from pathlib import Path

import torch

from grpo_lab.learner import distributed
from tests.fsdp_common import (SGD_LR, SGD_SETTINGS, ADAM_SETTINGS, grouped_batch, make_learner, silent_batches,
                               toy_batch)

model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])

# 1. Plain SGD: the parameter change is -lr × the summed gradient, so a gradient averaged
#    over ranks (FSDP2's default) instead of summed would show here (AdamW's first step would hide it).
learner = make_learner(model_dir, strategy="fsdp2", **SGD_SETTINGS)
learner.optimizer = torch.optim.SGD(learner.policy.parameters(), lr=SGD_LR)
batch = toy_batch(n=9)
learner.score(batch)
metrics = learner.update(batch)
sgd = dict(learner.weights_for_sync())

# 2. Rows without gradient left out (learner.skip_rows_without_gradient), plain SGD: 7 of 12 rows
#    trained, then a batch with none, where every rank runs just the zero-weight pass.
learner = make_learner(model_dir, strategy="fsdp2", skip_rows_without_gradient=True, **ADAM_SETTINGS)
learner.optimizer = torch.optim.SGD(learner.policy.parameters(), lr=SGD_LR)
for batch in silent_batches():
    learner.score(batch)
    learner.update(batch)
skipped = dict(learner.weights_for_sync())

# 2b. Shared prompt forwards (learner.shared_prompt_forward): two forwards of the sharded model per
#     micro-batch before one backward, 2 minibatches regrouped by prompt, a KL reference sharing too.
learner = make_learner(model_dir, strategy="fsdp2", shared_prompt_forward=True, **SGD_SETTINGS)
learner.optimizer = torch.optim.SGD(learner.policy.parameters(), lr=SGD_LR)
batch = grouped_batch(seed=3)
learner.score(batch)
learner.update(batch)
shared = dict(learner.weights_for_sync())

# 3. The default AdamW update, then a DCP checkpoint of model + optimizer and the learner's other state.
learner = make_learner(model_dir, strategy="fsdp2", **ADAM_SETTINGS)
batch = toy_batch(n=10)
learner.score(batch)
adam_metrics = learner.update(batch)
adam = dict(learner.weights_for_sync())
ckpt = out / "ckpt"
learner.save(ckpt / "policy")
learner.save_dcp(ckpt / distributed.DCP_DIR)
state = learner.state_dict()
if distributed.rank() == 0:
    torch.save({"sgd": sgd, "sgd_metrics": metrics, "skipped": skipped, "shared": shared, "adam": adam, "adam_metrics": adam_metrics,
                "state": state, "world_size": distributed.world_size()}, out / "fsdp.pt")
else:
    assert sgd == {} and adam == {} and skipped == {} and shared == {}, "only rank 0 receives the full state dict"
distributed.end_process()   # not a plain exit: see end_process
