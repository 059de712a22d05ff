"""Matched-compute SFT control: continue supervised training from the RL runs' warm-up checkpoint
for a wall-time budget, then evaluate exactly as the RL runs do.

    python -m grpo_lab.tables.sft_control --wall-time 40 --run-dir outputs/x/sft_control_s0 -- seed=0 rollout=hf
    (scripts/sft_control.py is the same command)

Why: RL from a warm-up checkpoint beats the checkpoint, but the question a table must answer is
whether it beats *spending the same compute on more SFT* (tables/algorithms.md and tables/tasks.md
hold the answer at this scale). scripts/make_table.py runs this after a sweep, with the budget set to
the mean time the matched RL runs spent in their steps.

What is the same as an RL run (the overrides after `--` are the RL runs' own):
  - the start: grpo_lab.run_setup.start_run, the trainer's own set-up: the same seed, the same
    number of learner threads (learner.num_threads, or the trainer's rule when null), the same
    device and the same cached warm-up checkpoint (same model, task, warm-up settings and seed give
    the same cache key);
  - the training loop: grpo_lab.warmup.sft_loop, the warm-up's own loop (task.splits["train"]
    worked solutions, loss on completion tokens only), stopped by wall time instead of accuracy;
  - the evaluation: grpo_lab.evaluation.Evaluator (greedy, and mean@k with
    trainer.eval_sampled_k; trainer.eval_split, rollout.max_new_tokens) with an HF engine sharing
    the trained weights, before, `--evals` times during, and after training;
  - the record: grpo_lab.run_setup's recorder writes config.yaml, metrics.jsonl and summary.json
    (with learner_threads) in the trainer's format (and wandb when logger=wandb), so the report
    treats the run as one more group.
What differs, on purpose: the optimiser is a fresh AdamW at the warm-up's lr and batch size
(warmup.lr, warmup.batch_size): this is "more of the warm-up", not RL's lr. The budget counts only
training time (evaluation excluded), as the RL side's sum of perf/step_time_s does. `samples` in
metrics.jsonl counts supervised examples, not generated completions. The RL runs evaluate with their
rollout engine (vLLM or HF); greedy decoding gives the same tokens up to float round-off.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpo_lab.tables.spec import CONF


def compose_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo_lab.config import finalize, register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=overrides))


def sft_control(cfg, recorder, *, wall_time_s: float, evals: int) -> dict:
    """Train for `wall_time_s` seconds of optimizer steps; log like the trainer; return before/after."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_lab.evaluation import Evaluator
    from grpo_lab.learner.trainable import TrainableModel
    from grpo_lab.warmup import SFTProgress, sft_loop, shared_weights_engine
    from grpo_lab.run_setup import log_initial_eval, start_run

    start = start_run(cfg)   # the RL runs' seed, learner threads, device, warm-up checkpoint and tokenizer
    task, tokenizer, device = start.task, start.tokenizer, start.device
    model = AutoModelForCausalLM.from_pretrained(str(start.policy_dir), dtype=torch.float32).to(device)
    engine = shared_weights_engine(model, tokenizer)  # every evaluation sees the current weights
    # The warm-up's optimizer (torch's AdamW default weight decay, 0.01), continued.
    trainable = TrainableModel(model, lr=cfg.warmup.lr, weight_decay=0.01)
    evaluator = Evaluator.of(engine, tokenizer, task.splits[cfg.trainer.eval_split], rollout=cfg.rollout,
                             trainer=cfg.trainer, interaction=cfg.interaction, seed=cfg.seed)

    def run_eval(step: int) -> dict:   # as the RL runs evaluate (greedy, and mean@k when they do)
        with torch.no_grad():
            return evaluator(step=step)

    before = run_eval(0)
    log_initial_eval(recorder, start, before)
    eval_at = [wall_time_s * k / (evals + 1) for k in range(1, evals + 1)]

    def on_step(p: SFTProgress) -> None:
        metrics = {"sft/loss": p.loss, "perf/step_time_s": p.step_time_s, "perf/trained_s": p.trained_s}
        if eval_at and eval_at[0] <= p.trained_s < wall_time_s:  # the last evaluation is `after`
            while eval_at and p.trained_s >= eval_at[0]:
                eval_at.pop(0)
            metrics.update(run_eval(p.step))
        recorder.log(metrics, step=p.step, samples=p.samples)

    last = sft_loop(trainable, tokenizer, task.splits["train"], batch_size=cfg.warmup.batch_size,
                    seed=cfg.seed, device=device, max_train_s=wall_time_s, on_step=on_step)
    after = run_eval(last.step)
    recorder.log(after, step=last.step, samples=last.samples)
    return {"before": before, "after": after, "steps": last.step, "trained_s": last.trained_s,
            "warmup": start.warmup_summary, "learner_threads": start.threads}


def main(argv: list[str] | None = None, prog: str = "python -m grpo_lab.tables.sft_control") -> int:
    argv = sys.argv[1:] if argv is None else argv
    overrides: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                epilog="Everything after `--` is a Hydra override of conf/config.yaml, as for "
                                       "python -m grpo_lab.train.")
    p.add_argument("--wall-time", type=float, required=True, help="seconds of training (evaluation excluded)")
    p.add_argument("--run-dir", type=Path, required=True, help="run directory to write (created)")
    p.add_argument("--evals", type=int, default=3, help="evaluations during training (plus before and after)")
    args = p.parse_args(argv)
    if args.wall_time <= 0:
        p.error("--wall-time must be > 0")

    from omegaconf import OmegaConf

    from grpo_lab.config import validate
    from grpo_lab.launch import record_outcome
    from grpo_lab.run_setup import open_recorder

    # `+variant=...` labels the row for make_table's grouping; it is recorded, not composed.
    labels = [o for o in overrides if o.lstrip("+").startswith("variant=")]
    cfg = compose_config([o for o in overrides if o not in labels])
    validate(cfg)
    OmegaConf.set_struct(cfg, False)
    cfg.algorithm.name = "sft_control"   # wandb job_type and the report's algorithm column
    cfg.run_name = f"sft_control_s{cfg.seed}"
    cfg.sft_control = {"wall_time_s": args.wall_time, "lr": cfg.warmup.lr, "batch_size": cfg.warmup.batch_size,
                       "evals": args.evals, "note": "continued SFT from the warm-up checkpoint (scripts/sft_control.py)"}
    OmegaConf.set_struct(cfg, True)
    recorder = open_recorder(args.run_dir, cfg, overrides)
    result = record_outcome(
        recorder, lambda: sft_control(cfg, recorder, wall_time_s=args.wall_time, evals=args.evals),
        lambda r: {"warmup": r["warmup"], "trained_s": r["trained_s"], "learner_threads": r["learner_threads"]})
    b, a = result["before"]["eval/accuracy"], result["after"]["eval/accuracy"]
    print(f"SFT control: {result['steps']} steps in {result['trained_s']:.1f} s; held-out accuracy "
          f"{b:.1%} -> {a:.1%} ({100 * (a - b):+.1f} points); run: {args.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
