"""Where the learner and the rollout engine run (`trainer.backend`): one registry, one signature.

    TRAINER_BACKENDS[name](cfg) -> (build_learner, build_engine)
        build_learner(cfg, policy_dir, *, temperature, seed, max_completion_len) -> a Learner or a proxy
        build_engine(model_dir, rollout_cfg, *, seed, device) -> a RolloutEngine or a proxy

Facts: `requires_module` (a package the backend needs, checked before anything loads) and
`spawns_engine` (the engine's processes are this process's children, so they inherit the CPU cores
of the thread that starts them: trainer.cpu_placement can place them). The train loop calls whatever
comes back the same way, so it never asks which backend it runs on.
"""

from __future__ import annotations

from grpo_lab.registry import Registry

TRAINER_BACKENDS = Registry("trainer backend", defaults={"requires_module": None, "spawns_engine": False})


@TRAINER_BACKENDS.register("local", spawns_engine=True)
def local(cfg):
    """This process (learner.strategy=fsdp2: rank 0's handle, each call runs on every torchrun rank)."""
    from grpo_lab.learner import distributed
    from grpo_lab.rollout import make_engine

    return distributed.make_learner, make_engine


@TRAINER_BACKENDS.register("engine_process", spawns_engine=True)
def engine_process(cfg):
    """The learner in this process, the rollout engine (vLLM's client included) in a child process, so
    that with trainer.max_staleness=1 the client's Python work runs beside the learner instead of
    taking turns with it on one interpreter (grpo_lab/rollout/engine_process.py)."""
    import torch

    from grpo_lab.learner import distributed
    from grpo_lab.rollout.engine_process import EngineProcess

    def build_engine(model_dir, rollout_cfg, *, seed, device):
        # The learner's thread budget (train() set it): the HF engine generates with it in the child.
        return EngineProcess(model_dir, rollout_cfg, seed=seed, device=device, num_threads=torch.get_num_threads())

    return distributed.make_learner, build_engine


@TRAINER_BACKENDS.register("ray", requires_module="ray")
def ray(cfg):
    """Ray actors in one placement group, behind proxies with the same methods (grpo_lab/ray_backend.py)."""
    from grpo_lab.ray_backend import ray_builders

    remote_learner, remote_engine = ray_builders(cfg)

    def build_learner(cfg, policy_dir, **kwargs):
        return remote_learner(policy_dir, learner_cfg=cfg.learner, algo_cfg=cfg.algorithm, **kwargs)

    return build_learner, remote_engine
