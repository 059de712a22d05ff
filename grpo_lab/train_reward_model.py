"""Train a reward model: `python -m grpo_lab.train_reward_model [overrides]` (make train-rm).

The same composed config as a run (task, model, warm-up, rollout, reward), read for its top-level
`reward_model` section: the trunk (by default the run's starting policy, the warm-up checkpoint), the
preferences (a JSONL file, or the starting policy's samples labelled by a gold reward, with a pair budget and
a label-noise rate), the ranking loss and the training with early stopping on held-out accuracy
(grpo_lab/second_models/reward_model_training.py). The trained models are cached by content under
<cache_dir>/reward_models/<key>/member_<i> (directories AutoModelForSequenceClassification loads); a run with
reward=reward_model and the same settings finds them there, or names them with reward.reward_model.dirs=[...].
The run directory (outputs/reward_models/<time>) holds the held-out metrics per evaluation (metrics.jsonl,
and wandb with logger=wandb) and summary.json with the directories and the data's statistics.

    python -m grpo_lab.train_reward_model reward_model.data.pairs=500 reward_model.data.label_noise=0.2
    python -m grpo_lab.train_reward_model reward_model.data.source=jsonl reward_model.data.path=prefs.jsonl
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from grpo_lab import run_guard
from grpo_lab.config import finalize, register_configs, validate
from grpo_lab.launch import CONF_DIR, quiet_unless_verbose
from grpo_lab.launch import record_outcome
from grpo_lab.run_setup import open_recorder, start_run
from grpo_lab.schema import typed_sections


def train(cfg: DictConfig, recorder) -> dict:
    """Build (or find cached) the reward models; log each member's held-out evaluations; their stats."""
    from grpo_lab.second_models.reward_model_training import build_reward_models

    typed = typed_sections(cfg)
    start = start_run(typed)
    dirs, stats = build_reward_models(typed, start)
    for i, member in enumerate(stats["members"]):
        for entry in member["history"]:
            recorder.log({**{k: v for k, v in entry.items() if k != "step"}, "reward_model/member": float(i)},
                         step=int(entry["step"]) + i * typed.reward_model.max_steps, samples=0)
    return {"dirs": [str(d) for d in dirs], **{k: v for k, v in stats.items() if k != "members"},
            "best": [m["best"] for m in stats["members"]]}


def run(cfg: DictConfig) -> float:
    # A cancelled job (kill, a scheduler's SIGTERM) unwinds like Ctrl-C: summary.json says failed and the
    # sampling engine's processes are shut down, as for a run.
    run_guard.install_sigterm()
    hc = HydraConfig.get()
    cfg = finalize(cfg)
    # Before any model loads: bad data files, settings, the trunk's directory; the reward_model section is read
    # here whatever the run's reward.
    validate(cfg, also_reads=("reward_model",))
    run_dir = Path(hc.runtime.output_dir)
    recorder = open_recorder(run_dir, cfg, list(hc.overrides.task))
    with run_guard.stuck_sigterm_recorded(recorder):
        result = record_outcome(recorder, lambda: train(cfg, recorder), lambda r: {"reward_model": r})
    print(f"\nreward model(s): {', '.join(result['dirs'])}\nheld-out accuracy {result['held_out_accuracy']:.3f} "
          f"(data: {result['data']})\nuse them: reward=reward_model reward.reward_model.dirs=[{','.join(result['dirs'])}]"
          f"\nrun: {run_dir}\n")
    return float(result["held_out_accuracy"])


def main() -> None:
    quiet_unless_verbose()   # -v keeps the libraries' start-up output, as for a run
    register_configs()
    args = sys.argv[1:]
    # Its own place beside the runs (unless the command names one), and its own job name for the log file.
    defaults = {"hydra.run.dir": "outputs/reward_models/${now:%Y-%m-%d_%H-%M-%S}", "hydra.job.name": "train_reward_model"}
    sys.argv[1:] = [f"{k}={v}" for k, v in defaults.items() if not any(a.startswith(k + "=") for a in args)] + args

    @hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
    def task(cfg: DictConfig) -> float:
        return run(cfg)

    task()


if __name__ == "__main__":
    main()
