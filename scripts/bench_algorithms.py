"""Peak memory and step time of algorithm recipes on the same model and batch, measured in one run,
with ratios against a baseline measured in that same run (default: ppo, which trains a critic, vs
grpo).

    python scripts/bench_algorithms.py                         # ppo vs grpo, tiny model, 10 timed steps
    python scripts/bench_algorithms.py --algorithms ppo dapo grpo --steps 20 --repeats 2
    python scripts/bench_algorithms.py model.hidden_size=512 model.num_layers=8   # any Hydra override
    python scripts/bench_algorithms.py --algorithms ppo grpo rloo gspo --baseline ppo --engine recipe \
        --steps 3 --warmup 1 experiment=smollm2_chain_sum    # the SmolLM2 recipe: LoRA, bf16, vLLM

How it measures, and why:

* Each algorithm runs the real training loop (`grpo_lab.train`; HF rollout engine, or with
  --engine recipe the engine the config names, e.g. vLLM) in its own subprocess, so memory peaks
  never mix and nothing but the recipe differs: same config groups, model, seed, prompts and
  batch size (trainer.prompts_per_step × rollout.group_size sequences of at most
  rollout.max_new_tokens tokens). The first step's batch is identical for every algorithm
  (same model, prompts and sampling seed); later ones differ only as far as the policies do. Mean
  completion length is printed so the batches can be compared.
* Step time is the loop's own `perf/step_time_s` (rollout + rewards + learner + weight push); the
  learner-only cost is its `perf/learn_s` (scoring, advantages, all μ × minibatch updates of
  policy and critic). Both are medians over --steps steps after --warmup untimed ones. "step CPU s"
  is the process's CPU time per step over the same steps (all threads): on a shared machine other
  jobs stretch wall time far more than CPU time. Set torch threads with learner.num_threads=N.
* Peak memory is the subprocess's peak resident set (getrusage ru_maxrss), printed in full and as
  the growth over the same process's peak right after importing torch/transformers/grpo_lab (the
  interpreter and libraries are the same for every algorithm and would swamp a tiny model). "tree
  peak" is the peak resident memory of the subprocess and all its children (vLLM's engine
  processes), sampled every --sample-every seconds as scripts/peak_tree_rss.py does: what the
  machine must hold. Resident sets of processes sharing pages (fork) are summed, so it is an upper
  bound. With CUDA the learner's torch.cuda.max_memory_allocated is printed too.
* With --repeats R the algorithms alternate (A B A B ...) and each number is the median, so a
  slow patch of a shared machine does not land on one algorithm only.

Defaults: rollout=hf (unless --engine recipe), logger=none, warmup.max_steps=0 (a random model:
weights do not change the cost of a step, only the completion lengths; pass warmup.max_steps=1500 to
bench the warmed-up model), no periodic evaluation (the loop's step-0 evaluation still runs, outside
the timed steps), small eval split. --workdir keeps each run's directory and log. This is a
benchmark, not a test: it asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from peak_tree_rss import peak_while_running   # this script's own directory is on sys.path

REPO = Path(__file__).resolve().parents[1]
DEFAULTS = ["logger=none", "warmup.max_steps=0", "trainer.eval_every=0", "task.train_size=4000",
            "task.dev_size=20", "task.test_size=20", "hydra/job_logging=none", "hydra/hydra_logging=none"]


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def child(args: argparse.Namespace) -> None:
    """One algorithm, in this (fresh) process: run the loop, write what it measured to --out."""

    import torch

    import grpo_lab.train as train  # imports torch, transformers and the package before the baseline

    baseline = _maxrss_mib()
    sys.argv = ["grpo_lab.train", "--config-path", str(REPO / "conf"), "--config-name", "config", *args.overrides]
    try:
        train.main()
    except SystemExit as exc:
        if exc.code:
            raise
    out = {"peak_rss_mib": _maxrss_mib(), "baseline_rss_mib": baseline, "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        out["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    Path(args.out).write_text(json.dumps(out))


def run_one(algorithm: str, args: argparse.Namespace, workdir: Path, tag: str) -> dict:
    run_dir, out = workdir / f"{algorithm}_{tag}", workdir / f"{algorithm}_{tag}.json"
    engine = ["rollout=hf"] if args.engine == "hf" else []
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--out", str(out), "--",
           f"algorithm={algorithm}", *engine, *DEFAULTS, f"trainer.total_steps={args.warmup + args.steps}",
           *args.overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log = workdir / f"{algorithm}_{tag}.log"
    with log.open("w") as sink:   # a file, not a pipe: nothing blocks while the parent samples memory
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
        tree_peak_gib = peak_while_running(proc, args.sample_every)
    if proc.returncode != 0:
        sys.exit(f"{algorithm} failed (exit {proc.returncode}):\n{log.read_text()[-6000:]}")
    result = json.loads(out.read_text())
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines() if s.strip()]
    timed = [m for m in lines if "perf/step_time_s" in m][args.warmup:]
    median = lambda key: statistics.median(m[key] for m in timed)  # noqa: E731
    cfg = (run_dir / "config.yaml").read_text()
    # CPU seconds of the trainer process per step, as the loop itself logs them (perf/cpu_time_s): a
    # shared machine stretches wall time far more than the CPU time a step needs.
    result.update(cpu_step_s=median("perf/cpu_time_s"), tree_peak_mib=tree_peak_gib * 1024,
                  step_s=median("perf/step_time_s"), learn_s=median("perf/learn_s"),
                  rollout_s=median("perf/rollout_s"), samples=median("rollout/samples"),
                  completion_len=median("rollout/completion_len_mean"), models=_models(run_dir), config=cfg)
    print(f"  {algorithm}: " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                            for k, v in result.items() if k != "config"}), file=sys.stderr, flush=True)
    return result


def _models(run_dir: Path) -> str:
    """What the learner holds for this recipe: the policy, a reference (KL or DPO), a critic."""
    from omegaconf import OmegaConf

    from grpo_lab.objectives import OBJECTIVES

    a = OmegaConf.load(run_dir / "config.yaml").algorithm
    objective = OBJECTIVES.get(a.objective)
    models = ["policy"]
    if objective.needs_reference(a):
        models.append("ref")
    if objective.needs_critic(a):
        models.append("critic")
    return "+".join(models)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=["ppo", "grpo"],
                        help="recipes (conf/algorithm/*.yaml) to measure (default: ppo grpo)")
    parser.add_argument("--baseline", default=None, help="recipe the ratios divide by (default: the last one)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per algorithm (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--repeats", type=int, default=1, help="alternate the algorithms this many times; medians")
    parser.add_argument("--engine", choices=["hf", "recipe"], default="hf",
                        help="rollout engine: hf (default) or recipe (the one the config names, e.g. vLLM)")
    parser.add_argument("--sample-every", type=float, default=1.0,
                        help="seconds between samples of the process tree's resident memory (default 1)")
    parser.add_argument("--workdir", default=None,
                        help="keep each run's directory and log here (default: a temporary directory)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every algorithm")
    args = parser.parse_args()
    if args.child:
        return child(args)

    baseline = args.baseline or args.algorithms[-1]
    if baseline not in args.algorithms:
        parser.error(f"--baseline {baseline} is not among --algorithms {args.algorithms}")
    runs: dict[str, list[dict]] = {a: [] for a in args.algorithms}
    if args.workdir:   # absolute: the children run in the repository root, this process maybe not
        args.workdir = Path(args.workdir).resolve()
        args.workdir.mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(args.workdir) if args.workdir else tempfile.TemporaryDirectory(
            prefix="bench_algorithms_") as tmp:
        for r in range(args.repeats):
            order = args.algorithms if r % 2 == 0 else args.algorithms[::-1]
            for algo in order:
                print(f"[{r + 1}/{args.repeats}] {algo} ...", file=sys.stderr, flush=True)
                runs[algo].append(run_one(algo, args, Path(tmp), tag=str(r)))

    def med(algo: str, key: str) -> float | None:
        vals = [x[key] for x in runs[algo] if x.get(key) is not None]
        return statistics.median(vals) if vals else None

    cols = [("step_s", "step s", "{:.4f}"), ("cpu_step_s", "step CPU s", "{:.4f}"), ("learn_s", "learner s", "{:.4f}"), ("rollout_s", "rollout s", "{:.4f}"),
            ("tree_peak_mib", "tree peak MiB", "{:.1f}"),
            ("peak_rss_mib", "peak RSS MiB", "{:.1f}"), ("growth_mib", "RSS growth MiB", "{:.1f}"),
            ("cuda_peak_mib", "CUDA peak MiB", "{:.1f}")]
    for algo in args.algorithms:
        for x in runs[algo]:
            x["growth_mib"] = x["peak_rss_mib"] - x["baseline_rss_mib"]
    cols = [c for c in cols if any(med(a, c[0]) is not None for a in args.algorithms)]
    first = runs[baseline][0]
    print(f"\nbench: {args.steps} timed steps after {args.warmup} warm-up, {args.repeats} repeat(s), "
          f"engine {args.engine}, torch threads {first['threads']}; batch {first['samples']:.0f} sequences per step; "
          f"overrides: {' '.join(args.overrides) or '(none)'}")
    head = f"{'algorithm':<24}{'learner holds':<20}{'mean len':>9}" + "".join(f"{c[1]:>16}" for c in cols)
    print(head)
    print("-" * len(head))
    for algo in args.algorithms:
        row = f"{algo:<24}{runs[algo][0]['models']:<20}{med(algo, 'completion_len'):>9.2f}"
        print(row + "".join(f"{c[2].format(med(algo, c[0])):>16}" for c in cols))
    for algo in args.algorithms:
        if algo == baseline:
            continue
        ratios = []
        for key, label, _ in cols:
            num, den = med(algo, key), med(baseline, key)
            ratios.append(f"{(num / den if num is not None and den else float('nan')):>15.2f}x")
        print(f"{'ratio ' + algo + '/' + baseline:<53}" + "".join(ratios))


if __name__ == "__main__":
    main()
