"""`trainer.backend=ray`: the learner and the rollout engine as Ray actors, behind thin proxies.

The train loop does not change: with trainer.backend=local it builds `Learner` and `make_engine` as
always; with `ray`, `ray_builders(cfg)` hands it two constructors that start Ray actors and return proxies with the same methods
(`RemoteLearner`, `RemoteEngine`). Every proxy call is `ray.get(actor.method.remote(...), timeout=...)`.

    driver (train loop, task, rewards, logging)
      ├─ RemoteLearner ──▶ LearnerActor  (bundle 0: CPU, or a GPU when learner.device is CUDA)
      └─ RemoteEngine  ──▶ EngineActor   (bundle 1: CPU, or rollout.tensor_parallel_size GPUs)

Placement: one placement group holds a bundle per actor (PACK: same node when it fits, else spread).
On a CUDA cluster with a single GPU both actors share one bundle (0.5 GPU each), as the local run
colocates the learner and its engine on one device.

Weight push: `learner.weights_for_sync()` returns a `RemoteWeights` handle, the ObjectRef of the
learner actor's named tensors (stored once in the object store by the actor's return); the engine
proxy passes that reference to the engine actor, which Ray resolves there: the tensors never travel
through the driver.

Cluster: `RAY_ADDRESS` set (e.g. by scripts/slurm_ray.sh after `ray start --head`) connects to that
cluster; otherwise a local one starts with as many CPUs as the actors' bundles need. The model
directory and the run directory must be on a filesystem every node sees (a shared home or scratch
under Slurm), since actors load and save by path. Only the CPU path runs on this machine; the GPU
bundles are written, not run here.

The session ends with the loop's `engine.close()` (its `finally`): actors killed, placement group
removed, Ray shut down (also at interpreter exit, if the loop never reached it).
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Iterable

import torch
from omegaconf import DictConfig, OmegaConf

from grpo_lab.learner.learner import Learner, resolve_device, set_cpu_threads
from grpo_lab.objectives import OBJECTIVES
from grpo_lab.rollout import ROLLOUT_ENGINES, make_engine
from grpo_lab.rollout.errors import EngineDeadError, EngineTimeoutError

BACKENDS = ("local", "ray")
# Seconds any one proxied call may take (GRPO_LAB_RAY_TIMEOUT_S overrides); the engine's own timeouts
# (rollout.generate_timeout_s / sync_timeout_s), when set, bound generate and load_weights instead.
DEFAULT_TIMEOUT_S = float(os.environ.get("GRPO_LAB_RAY_TIMEOUT_S", 3600))
# Seconds to wait for the placement group's resources before failing with what was asked for.
PLACEMENT_TIMEOUT_S = float(os.environ.get("GRPO_LAB_RAY_PLACEMENT_TIMEOUT_S", 120))


def ray_builders(cfg: DictConfig):
    """(build_learner, build_engine) for trainer.backend=ray: called exactly as `Learner(...)` and
    `make_engine(...)` are, they start the actors (one session, one placement group) and return proxies."""
    session = RaySession(cfg)
    return session.learner, session.engine


def _plain(node):
    """A config node as a standalone, resolved DictConfig (a child node would pickle its whole root)."""
    if isinstance(node, DictConfig):
        return OmegaConf.create(OmegaConf.to_container(node, resolve=True))
    return node


def placement_bundles(cfg: DictConfig, *, cuda: bool, cluster_gpus: float = 0.0) -> tuple[list[dict], dict]:
    """Bundles of the placement group and, per actor, (bundle index, num_cpus, num_gpus).

    CPU: one 1-CPU bundle each (the actors take turns in the synchronous loop; each sets its own torch
    threads). CUDA: the learner gets one GPU, the engine rollout.tensor_parallel_size ×
    rollout.data_parallel_size GPUs; with a single GPU in the cluster both
    share it in one bundle."""
    if not cuda:
        return [{"CPU": 1}, {"CPU": 1}], {"learner": (0, 1, 0), "engine": (1, 1, 0)}
    # Every engine replica (rollout.data_parallel_size) runs tensor_parallel_size ranks, each on a GPU of
    # its own, all inside the one engine actor (data_parallel.placement_env slices its visible GPUs).
    gpus = int(cfg.rollout.tensor_parallel_size) * int(cfg.rollout.data_parallel_size)
    if cluster_gpus < 2:
        return [{"CPU": 2, "GPU": 1}], {"learner": (0, 1, 0.5), "engine": (0, 1, 0.5)}
    return [{"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": gpus}], {"learner": (0, 1, 1), "engine": (1, 1, gpus)}


class LearnerActor:
    """Runs in its own Ray worker process: a plain `Learner`, called by `RemoteLearner`."""

    def __init__(self, model_dir: str, kwargs: dict, num_threads: int):
        set_cpu_threads(num_threads)
        self.learner = Learner(model_dir, objective=OBJECTIVES.get(kwargs["algo_cfg"].objective), **kwargs)

    def call(self, method: str, *args, **kwargs):
        return getattr(self.learner, method)(*args, **kwargs)

    def call_on_batch(self, method: str, batch):
        """`method(batch)` plus what it wrote into the batch (score adds π_old, reference logprobs,
        values): the tensors it added or replaced, and its extras, for the proxy to write back."""
        before = dict(batch.tensors)
        result = getattr(self.learner, method)(batch)
        changed = {k: v for k, v in batch.tensors.items() if before.get(k) is not v}
        return result, changed, [k for k in before if k not in batch.tensors], batch.extras

    def weights_for_sync(self) -> list[tuple[str, torch.Tensor]]:
        # Returned, not ray.get: the caller gets an ObjectRef to this one stored copy.
        return [(name, t.detach().cpu().contiguous()) for name, t in self.learner.weights_for_sync()]

    def host_state_dict(self) -> dict:
        """The learner's state_dict with every tensor on the host. Ray pickles a tensor with its device,
        so CUDA optimizer moments would be rebuilt on the driver's GPU 0, or fail on a driver with no GPU
        (a head node); `Optimizer.load_state_dict` moves them back to the parameters' device on resume."""
        return _to_host(self.learner.state_dict())

    def device(self) -> str:
        return str(self.learner.device)


def _to_host(obj):
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return obj


class EngineActor:
    """Runs in its own Ray worker process: the engine `make_engine` builds, called by `RemoteEngine`."""

    def __init__(self, model_dir: str, rollout_cfg, seed: int, device: str, num_threads: int):
        set_cpu_threads(num_threads)
        self.engine = make_engine(Path(model_dir), rollout_cfg, seed=seed, device=device)

    def generate(self, prompt_ids, **kwargs):
        return self.engine.generate(prompt_ids, **kwargs)

    def load_weights(self, named_tensors) -> None:
        self.engine.load_weights(named_tensors)

    def close(self) -> None:
        self.engine.close()


class RemoteWeights:
    """The learner actor's named tensors in the object store, by reference (see the module docstring)."""

    def __init__(self, ref, timeout_s: float):
        self.ref, self.timeout_s = ref, timeout_s

    def __iter__(self):   # a local consumer (not the engine actor) reads the tensors themselves
        import ray
        return iter(ray.get(self.ref, timeout=self.timeout_s))


class RemoteLearner:
    """The `Learner` methods the loop and checkpoints call, forwarded to a `LearnerActor`."""

    def __init__(self, actor, *, algo_cfg, timeout_s: float):
        self._actor, self.algo, self.timeout_s = actor, algo_cfg, timeout_s

    def _get(self, ref):
        import ray
        return ray.get(ref, timeout=self.timeout_s)

    def _call(self, method: str, *args, **kwargs):
        return self._get(self._actor.call.remote(method, *args, **kwargs))

    def _call_on_batch(self, method: str, batch):
        # The actor works on a copy: what the method wrote into the batch comes back into the caller's.
        result, changed, removed, extras = self._get(self._actor.call_on_batch.remote(method, batch))
        batch.tensors.update(changed)
        for k in removed:
            del batch.tensors[k]
        batch.extras.clear()
        batch.extras.update(extras)
        return result

    def score(self, batch):
        return self._call_on_batch("score", batch)

    def update(self, batch):
        return self._call_on_batch("update", batch)

    def parameters_finite(self) -> bool:
        return self._call("parameters_finite")

    def weights_for_sync(self) -> RemoteWeights:
        return RemoteWeights(self._actor.weights_for_sync.remote(), self.timeout_s)

    def save(self, path, tokenizer=None) -> None:
        self._call("save", str(path), tokenizer)

    def state_dict(self) -> dict:
        return self._get(self._actor.host_state_dict.remote())

    def load_state(self, policy_dir, state: dict) -> None:
        self._call("load_state", str(policy_dir), state)

    def close(self) -> None:
        """The loop's end-of-run call (a LearnerGroup releases its ranks there); the actor itself ends
        with the session (`RemoteEngine.close`)."""
        self._call("close")

    @property
    def device(self) -> torch.device:
        return torch.device(self._get(self._actor.device.remote()))


class RemoteEngine:
    """The rollout-engine protocol (generate, load_weights, close) forwarded to an `EngineActor`.
    Timeouts raise EngineTimeoutError and a dead actor EngineDeadError, as the in-process engines do."""

    def __init__(self, actor, session: "RaySession", *, generate_timeout_s: float, sync_timeout_s: float):
        self._actor, self._session = actor, session
        self.generate_timeout_s, self.sync_timeout_s = generate_timeout_s, sync_timeout_s

    def _get(self, ref, timeout_s: float, what: str):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(ref, timeout=timeout_s)
        except GetTimeoutError as err:
            # force=True is refused for actor tasks (ray.cancel: "Only force=False is allowed for an
            # Actor Task"); the run fails here and the session's shutdown ends the actor.
            ray.cancel(ref)
            raise EngineTimeoutError(f"the Ray engine actor's {what} took longer than {timeout_s:g} s",
                                     phase=what) from err
        except RayActorError as err:
            raise EngineDeadError(f"the Ray engine actor died during {what}: {err}", phase=what,
                                 engine_error=str(err)) from err

    def generate(self, prompt_ids, **kwargs):
        return self._get(self._actor.generate.remote(prompt_ids, **kwargs), self.generate_timeout_s, "generate")

    def load_weights(self, named_tensors: Iterable) -> None:
        # A RemoteWeights handle goes to the engine actor by reference (resolved there, not here).
        payload = named_tensors.ref if isinstance(named_tensors, RemoteWeights) else list(named_tensors)
        self._get(self._actor.load_weights.remote(payload), self.sync_timeout_s, "load_weights")

    def close(self) -> None:
        """Ends the whole Ray session (the loop's `finally` calls this last)."""
        self._session.shutdown()


class RaySession:
    """One run's Ray state: the cluster connection, the placement group and the two actors."""

    def __init__(self, cfg: DictConfig):
        import ray
        from ray.util.placement_group import placement_group

        self.cfg, self.actors, self.engine_actor, self.pg, self.closed = cfg, [], None, None, False
        self.started = False
        # Same thread budget as the in-process run (train() computed it): the actors take turns.
        self.num_threads = max(1, torch.get_num_threads())
        cuda = resolve_device(cfg.learner.device).type == "cuda"
        address = os.environ.get("RAY_ADDRESS")
        # Workers import grpo_lab from where the driver did (a checkout on the shared filesystem).
        root = str(Path(__file__).resolve().parents[1])
        pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        runtime_env = {"env_vars": {"PYTHONPATH": pythonpath, "TOKENIZERS_PARALLELISM": "false"}}
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")   # runs never wait on the network
        if not ray.is_initialized():
            if address:   # an existing cluster (scripts/slurm_ray.sh starts one under Slurm)
                try:
                    ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
                except ConnectionError as err:
                    raise ConnectionError(
                        f"trainer.backend=ray: could not join the Ray cluster at RAY_ADDRESS={address}: {err}. "
                        "Is its head running (`ray status`)? A head started by `ray start` uses token "
                        "authentication by default (Ray 2.60): set RAY_AUTH_MODE=token here, with the "
                        "cluster's ~/.ray/auth_token readable (scripts/slurm_ray.sh does both)") from err
            else:         # a local cluster just big enough for the two actors (CPU bundles)
                bundles, _ = placement_bundles(cfg, cuda=cuda, cluster_gpus=torch.cuda.device_count())
                ray.init(num_cpus=int(sum(b.get("CPU", 0) for b in bundles)), include_dashboard=False,
                         runtime_env=runtime_env, log_to_driver=True)
            self.started = True
        else:
            self.started = False
        atexit.register(self.shutdown)
        bundles, self.placement = placement_bundles(cfg, cuda=cuda,
                                                    cluster_gpus=ray.cluster_resources().get("GPU", 0.0))
        self.pg = placement_group(bundles, strategy="PACK", name=f"grpo_lab-{os.getpid()}")
        ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            have = ray.available_resources()
            self.shutdown()
            raise RuntimeError(f"trainer.backend=ray: the placement group {bundles} was not placed within "
                               f"{PLACEMENT_TIMEOUT_S:g} s; the cluster has {have} available "
                               f"(RAY_ADDRESS={address or 'unset: a local cluster'})")

    def _options(self, role: str) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        index, cpus, gpus = self.placement[role]
        return {"num_cpus": cpus, "num_gpus": gpus, "max_concurrency": 1, "max_restarts": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=index)}

    def learner(self, model_dir, *, learner_cfg, algo_cfg, **kwargs) -> RemoteLearner:
        import ray

        actor = ray.remote(LearnerActor).options(**self._options("learner")).remote(
            str(model_dir), {"learner_cfg": _plain(learner_cfg), "algo_cfg": _plain(algo_cfg), **kwargs},
            self.num_threads)
        self.actors.append(actor)
        proxy = RemoteLearner(actor, algo_cfg=algo_cfg, timeout_s=DEFAULT_TIMEOUT_S)
        proxy.device   # waits for the constructor: a model that fails to load fails here, with its error
        return proxy

    def engine(self, model_dir, rollout_cfg, *, seed: int, device: str = "cpu") -> RemoteEngine:
        import ray

        ROLLOUT_ENGINES.get(rollout_cfg.engine)   # an unknown engine fails before an actor starts
        actor = ray.remote(EngineActor).options(**self._options("engine")).remote(
            str(model_dir), _plain(rollout_cfg), seed, device, self.num_threads)
        self.actors.append(actor)
        self.engine_actor = actor
        gen_t = rollout_cfg.generate_timeout_s or DEFAULT_TIMEOUT_S
        sync_t = rollout_cfg.sync_timeout_s or DEFAULT_TIMEOUT_S
        proxy = RemoteEngine(actor, self, generate_timeout_s=gen_t, sync_timeout_s=sync_t)
        # The constructor's outcome (a failed model load surfaces here, bounded by the sync timeout).
        proxy._get(actor.__ray_ready__.remote(), sync_t, "start-up")
        return proxy

    def shutdown(self) -> None:
        """Close the engine, kill the actors, remove the placement group, shut Ray down (idempotent)."""
        if self.closed:
            return
        self.closed = True
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        if self.engine_actor is not None:
            try:
                ray.get(self.engine_actor.close.remote(), timeout=30)
            except Exception:   # noqa: BLE001 — a dead or stuck engine is killed below either way
                pass
        for actor in reversed(self.actors):
            ray.kill(actor, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)
        if self.started:    # a connection this session made (to a local cluster it started, or RAY_ADDRESS)
            ray.shutdown()


__all__ = ["BACKENDS", "ray_builders", "placement_bundles", "RemoteLearner", "RemoteEngine", "RemoteWeights",
           "RaySession"]
