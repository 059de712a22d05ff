"""Where the learner and the rollout engine run (`trainer.backend`): one registry, one signature.

    TRAINER_BACKENDS[name](cfg) -> (build_learner, build_engine)
        build_learner(cfg, policy_dir, *, temperature, seed, max_completion_len) -> a Learner or a proxy
        build_engine(model_dir, rollout_cfg, *, seed, device) -> a RolloutEngine or a proxy

Facts: `requires_module` (a package the backend needs, checked before anything loads) and
`spawns_engine` (the engine's processes are this process's children, so they inherit the CPU cores
of the thread that starts them: trainer.cpu_placement can place them). The train loop calls whatever
comes back the same way, so it never asks which backend it runs on. The learner over torchrun ranks
(learner.strategy=fsdp2: rank 0's `LearnerGroup`, the other ranks' `follow`) lives here too, since it
is how the local backends build their learner.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from grpo_lab.learner import distributed
from grpo_lab.learner.learner import Learner, set_cpu_threads
from grpo_lab.objectives import OBJECTIVES
from grpo_lab.registry import Registry

TRAINER_BACKENDS = Registry("trainer backend", defaults={"requires_module": None, "spawns_engine": False})


@TRAINER_BACKENDS.register("local", spawns_engine=True)
def local(cfg):
    """This process (learner.strategy=fsdp2: rank 0's handle, each call runs on every torchrun rank)."""
    from grpo_lab.rollout import make_engine

    return make_learner, make_engine


@TRAINER_BACKENDS.register("engine_process", spawns_engine=True)
def engine_process(cfg):
    """The learner in this process, the rollout engine (vLLM's client included) in a child process, so
    that with trainer.max_staleness=1 the client's Python work runs beside the learner instead of
    taking turns with it on one interpreter (grpo_lab/rollout/engine_process.py)."""
    import torch

    from grpo_lab.rollout.engine_process import EngineProcess

    def build_engine(model_dir, rollout_cfg, *, seed, device):
        # The learner's thread budget (train() set it): the HF engine generates with it in the child.
        return EngineProcess(model_dir, rollout_cfg, seed=seed, device=device, num_threads=torch.get_num_threads())

    return make_learner, build_engine


@TRAINER_BACKENDS.register("ray", requires_module="ray")
def ray(cfg):
    """Ray actors in one placement group, behind proxies with the same methods (grpo_lab/ray_backend.py)."""
    from grpo_lab.ray_backend import ray_builders

    remote_learner, remote_engine = ray_builders(cfg)

    def build_learner(cfg, policy_dir, **kwargs):
        return remote_learner(policy_dir, learner_cfg=cfg.learner, algo_cfg=cfg.algorithm, **kwargs)

    return build_learner, remote_engine


# ------------------------------------------------------------------- the learner over torchrun ranks
# learner.strategy=fsdp2 (grpo_lab/learner/distributed.py): rank 0 runs the loop and drives the
# other ranks' learners through a LearnerGroup; ranks > 0 run `follow` and nothing else.
_STOP = "__stop__"


class LearnerGroup:
    """Rank 0's handle: each method call runs on every rank's learner (broadcast first, then local);
    returns rank 0's result. Attributes that are not methods read rank 0's learner."""

    def __init__(self, learner):
        self.learner = learner

    def __getattr__(self, name):
        attr = getattr(self.learner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            sent_kwargs = {**kwargs, "tokenizer": None} if "tokenizer" in kwargs else kwargs
            sent_args = args[:1] if name == "save" else args   # save(path, tokenizer): files come from rank 0
            dist.broadcast_object_list([(name, sent_args, sent_kwargs)], src=0)
            return attr(*args, **kwargs)
        return call

    def close(self) -> None:
        """Release the other ranks (they leave `follow`); call once at the end of the run."""
        dist.broadcast_object_list([(_STOP, (), {})], src=0)
        dist.destroy_process_group()


def _learner(cfg, policy_dir, learner_kwargs: dict) -> Learner:
    """One rank's Learner, handed the objective the config names."""
    return Learner(policy_dir, objective=OBJECTIVES.get(cfg.algorithm.objective), learner_cfg=cfg.learner,
                   algo_cfg=cfg.algorithm, **learner_kwargs)


def make_learner(cfg, policy_dir: Path, **learner_kwargs):
    """The learner of a run: a plain Learner (learner.strategy=single), or under fsdp2 rank 0's
    LearnerGroup after sending the resolved config and model directory to the other ranks."""
    if cfg.learner.strategy != "fsdp2":
        return _learner(cfg, policy_dir, learner_kwargs)
    distributed.init()
    dist.broadcast_object_list([(cfg, str(policy_dir), learner_kwargs)], src=0)   # typed sections pickle whole
    return LearnerGroup(_learner(cfg, policy_dir, learner_kwargs))


def follow() -> None:
    """Entry of ranks > 0: build the learner rank 0 describes, then run every call it broadcasts."""
    distributed.init()
    box = [None]
    dist.broadcast_object_list(box, src=0)
    cfg, policy_dir, learner_kwargs = box[0]
    set_cpu_threads(cfg.learner.num_threads or int(os.environ.get("OMP_NUM_THREADS") or 1))
    learner = _learner(cfg, policy_dir, learner_kwargs)
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            name, args, kwargs = box[0]
            if name == _STOP:
                return
            getattr(learner, name)(*args, **kwargs)
    finally:
        dist.destroy_process_group()
