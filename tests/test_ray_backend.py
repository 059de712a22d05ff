"""trainer.backend=ray: the learner and the rollout engine as Ray actors on a local Ray cluster (CPU).

Two RL steps end to end must give the same metrics as the single-process run with the same seed
(wall-clock and perf/ keys aside): the HF engine is deterministic given its seed, the actors use the
same thread count, and the weights travel learner actor -> engine actor through the object store.
"""

import importlib.util
import json

import pytest
import torch
from omegaconf import OmegaConf

from helpers import TASK, read_metrics, run_train
from safetensors.torch import load_file

HAVE_RAY = importlib.util.find_spec("ray") is not None
NO_RAY = ("ray is not installed (pip install ray==2.60.0 -c requirements-cpu.lock, or requirements-cuda.lock on the "
          "cuda stack; pinned in requirements-cpu.txt and requirements-cuda.txt)")

# No warm-up (the brief's tiny model from scratch); an entropy bonus makes the update move the weights
# even though an untrained model earns no reward, so step 2 samples from pushed weights.
RUN = ["rollout=hf", "logger=none", "warmup.max_steps=0", "trainer.total_steps=2", "trainer.prompts_per_step=8",
       "rollout.group_size=4", "trainer.eval_every=0", *TASK, "algorithm.entropy_coef=0.01", "learner.lr=0.01"]
TIMING_KEYS = ("wall_time_s",)


def comparable(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("perf/") and k not in TIMING_KEYS} for m in lines]


# Methods of the Learner that only its own process calls (the objective's views, FSDP's distributed checkpoint,
# the optimizer and schedule it owns): a Ray run never calls them on the remote learner.
IN_PROCESS_ONLY = {"policy_logprobs", "learner_logprobs_from_update", "save_dcp", "optimizer", "scheduler"}


def test_the_remote_learner_answers_every_call_the_run_makes_on_a_learner():
    """While the end-to-end Ray run was in the slow tier, a learner.close() added for torchrun broke every Ray
    run's end unseen: RemoteLearner lacked the method. A method added to the Learner fails here until the
    remote learner has it too (or it is listed above as one only the learner's own process calls)."""
    from grpo_lab.learner.learner import Learner
    from grpo_lab.ray_backend import RemoteLearner

    public = {n for n in vars(Learner) if not n.startswith("_")}
    assert IN_PROCESS_ONLY <= public, "IN_PROCESS_ONLY names a method the Learner no longer has"
    missing = sorted(public - IN_PROCESS_ONLY - set(dir(RemoteLearner)))
    assert not missing, f"RemoteLearner (grpo_lab/ray_backend.py) lacks {missing}: a Ray run would fail calling them"


# Slow tier (two runs, one on a local Ray cluster); the contract above keeps the remote learner's methods in
# step with the Learner's in the default suite.
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_RAY, reason=NO_RAY)
def test_ray_backend_matches_single_process(tmp_path):
    cache = tmp_path / "cache"
    local = run_train(RUN, tmp_path / "local", cache)
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    # A checkpoint too: the learner actor's state comes back through Ray (host_state_dict).
    remote = run_train([*RUN, "trainer.backend=ray", "trainer.checkpoint_every=2"], tmp_path / "ray", cache)
    assert remote.returncode == 0, remote.stdout[-3000:] + remote.stderr[-3000:]
    assert "Started a local Ray instance" in remote.stdout + remote.stderr   # it really ran on Ray
    assert "LearnerActor" in remote.stdout + remote.stderr and "EngineActor" in remote.stdout + remote.stderr

    a, b = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "ray")
    assert [m["step"] for m in b] == [0, 1, 2, 2]
    assert comparable(a) == comparable(b)
    assert a[1]["actor/grad_norm"] > 0                       # the update moved the weights ...
    assert a[2]["actor/entropy"] != a[1]["actor/entropy"]    # ... and step 2 sampled from the pushed ones
    summary = json.loads((tmp_path / "ray" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    # The learner actor saved the final policy where the driver asked: the same weights as locally.
    wa = load_file(str(tmp_path / "local" / "checkpoints" / "final" / "model.safetensors"))
    wb = load_file(str(tmp_path / "ray" / "checkpoints" / "final" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    state = torch.load(tmp_path / "ray" / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=False)
    moments = state["learner"]["optimizer"]["state"]
    assert moments and all(s["exp_avg"].device.type == "cpu" for s in moments.values())


@pytest.mark.skipif(not HAVE_RAY, reason=NO_RAY)
def test_an_engine_call_past_its_timeout_raises_engine_timeout():
    """A Ray engine call that outlives rollout.generate_timeout_s fails the run with EngineTimeoutError
    naming the phase (Ray refuses a forced cancel of an actor task, which once turned this into a
    ValueError)."""
    import time

    import ray

    from grpo_lab.ray_backend import RemoteEngine
    from grpo_lab.rollout.errors import EngineTimeoutError

    @ray.remote
    class StuckEngine:
        def generate(self, prompt_ids, **kwargs):
            time.sleep(60)

    ray.init(num_cpus=1, include_dashboard=False)
    try:
        engine = RemoteEngine(StuckEngine.remote(), session=None, generate_timeout_s=1.0, sync_timeout_s=1.0)
        with pytest.raises(EngineTimeoutError, match="generate took longer than 1 s"):
            engine.generate([[1, 2]], n=2)
    finally:
        ray.shutdown()


def test_backend_is_validated():
    from grpo_lab.config import finalize, register_configs, validate
    from grpo_lab.schema import ConfigError
    from hydra import compose, initialize_config_dir

    from helpers import REPO

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = finalize(compose("config", overrides=["rollout=hf", "logger=none", "trainer.backend=slurm"]))
    with pytest.raises(ConfigError, match=r"trainer\.backend='slurm'"):
        validate(cfg, machine=False)


def test_placement_bundles():
    from grpo_lab.ray_backend import placement_bundles
    from grpo_lab.schema import Config

    cfg = OmegaConf.merge(OmegaConf.structured(Config), {"rollout": {"tensor_parallel_size": 2}})
    assert placement_bundles(cfg, cuda=False) == ([{"CPU": 1}, {"CPU": 1}],
                                                  {"learner": (0, 1, 0), "engine": (1, 1, 0)})
    bundles, where = placement_bundles(cfg, cuda=True, cluster_gpus=8)
    assert bundles == [{"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 2}] and where["engine"] == (1, 1, 2)
    bundles, where = placement_bundles(cfg, cuda=True, cluster_gpus=1)   # one GPU: shared, as locally
    assert bundles == [{"CPU": 2, "GPU": 1}] and where["learner"][2] + where["engine"][2] == 1
    # 2 replicas of a TP=2 engine: 4 GPUs in the engine's bundle (each replica slices its own 2 there).
    cfg = OmegaConf.merge(OmegaConf.structured(Config), {"rollout": {"tensor_parallel_size": 2, "data_parallel_size": 2}})
    bundles, where = placement_bundles(cfg, cuda=True, cluster_gpus=8)
    assert bundles == [{"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 4}] and where["engine"] == (1, 1, 4)
