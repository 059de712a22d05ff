"""`make bench`: where a default run's time goes, each phase against a baseline measured in the same run.

    PYTHONPATH=. .venv/bin/python scripts/bench.py                 # everything (TRL venv built on first use)
    PYTHONPATH=. .venv/bin/python scripts/bench.py --reps 7 --steps 150 --skip trl
    PYTHONPATH=. .venv/bin/python scripts/bench.py -- trainer.prompts_per_step=16   # Hydra overrides

Rows (A = the lab, B = the baseline; ratio = A / B, medians of --reps interleaved A B B A ... pairs,
so a slow patch of this shared 2-core machine does not land on one side only):

1. rollout   — `VLLMEngine.generate` (the rollout phase's engine call) vs raw `vllm.LLM.generate`
               on the same LLM, prompts (trainer.prompts_per_step train prompts), G and seeds.
2. learner   — `Learner.score` + `Learner.update` vs a plain torch loop (forward, token logprobs,
               policy-gradient loss, backward per micro-batch, AdamW step) on the same sequences
               (a real rollout of the start model), micro-batch and torch threads.
3. sync      — the weight push, old protocol (pickled tensors) vs the new one, and its share of
               the step; the step is rollout + learner + new push measured here (the rewards, a
               few ms, left out).
4. overlap   — whole-loop step time with trainer.max_staleness=0 vs 1 (median perf/step_time_s
               of `python -m grpo_lab.train` runs), when the key exists; and max_staleness=1 with
               the engine in a child process (trainer.backend=engine_process) and, with ray
               installed, as a Ray actor (trainer.backend=ray), against the same synchronous runs.
               The settings run in rotating order.
5. skip rows — whole runs with learner.skip_rows_without_gradient=true vs false (the default), the
               same seed and steps, rotating order: median learner phase (perf/learn_s) and step
               (perf/step_time_s), the share of rows without gradient (a group whose rewards agree
               has A = 0), and the held-out greedy accuracy of both final models.
6. shared    — the same with learner.shared_prompt_forward=true vs false: each distinct prompt's
               forward once, its G completions on its cached keys/values (arXiv 2506.05433).
7. TRL       — the whole RL phase of `python -m grpo_lab.train` (sum of perf/step_time_s: no
               start-up, warm-up or evals) vs TRL `GRPOTrainer.train()` (its own venv under
               .cache/trl_venv, trl==1.16.0, built with `-c requirements-<stack>.lock`), same warm-up
               checkpoint, task, G, prompts per step, steps, lr, temperature, β=0, token-mean
               loss; both final models scored by `grpo_lab.evaluation.evaluate` (greedy, the test
               split) on the same HF engine. One run each (too long to repeat here). Any recipe:
               `--skip phases overlap --steps 8 experiment=smollm2_chain_sum` (make
               bench-trl-smollm2) gives TRL the same chat conversation, LoRA (peft), bf16
               autocast, temperature and answer reader as the lab's run.

Nothing here asserts a timing; it prints numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

TRL_VENV = REPO / ".cache" / "trl_venv"
TRL_PIN = "trl==1.16.0"


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from grpo_lab.config import finalize, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return finalize(hydra_compose("config", overrides=["logger=none", *overrides]))


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def interleave(a, b, reps: int) -> tuple[list[float], list[float]]:
    """Seconds of a() and b(), alternating A B, B A, ... after one untimed call each."""
    a(), b()
    ta, tb = [], []
    for r in range(reps):
        for name in ("ab" if r % 2 == 0 else "ba"):
            fn, out = (a, ta) if name == "a" else (b, tb)
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return ta, tb


# ------------------------------------------------------------------------------------- rows 1-3
def learner_step(learner, roll, pad_id: int):
    """(step, advantages): step() is one Learner.score + update on a fresh batch of the fixed rollout
    `roll`, with fixed random advantages (the learner's work does not depend on their values)."""
    import torch

    from grpo_lab.learner.batch import collate

    mask = collate(roll.prompt_ids, roll.completion_ids, pad_id, roll.sampler_logprobs)["response_mask"]
    adv = torch.randn(len(mask), 1, generator=torch.Generator().manual_seed(0)).expand_as(mask).clone()

    def step():
        batch = collate(roll.prompt_ids, roll.completion_ids, pad_id, roll.sampler_logprobs)
        learner.score(batch)
        batch["advantages"], batch["loss_mask"] = adv, batch["response_mask"]
        learner.update(batch)
    return step, adv


def bench_shared_learner(overrides: list[str], policy_dir: Path, task, reps: int) -> dict:
    """The learner phase alone, learner.shared_prompt_forward on vs off, on one fixed rollout of the
    start model (interleaved): what sharing saves without the rollout's and the run's noise around it."""
    from transformers import AutoTokenizer

    from grpo_lab.learner.batch import encode_prompt
    from grpo_lab.learner.learner import Learner
    from grpo_lab.objectives import OBJECTIVES
    from grpo_lab.rollout import make_engine
    from grpo_lab.run_setup import set_learner_threads

    cfgs = {k: compose([*overrides, f"learner.shared_prompt_forward={k == 'on'}"]) for k in ("on", "off")}
    cfg = cfgs["on"]
    threads = set_learner_threads(cfg)   # the trainer's own thread rule
    tok = AutoTokenizer.from_pretrained(str(policy_dir))
    r = cfg.rollout
    prompts = [encode_prompt(tok, it.prompt) for it in task.splits["train"][:cfg.trainer.prompts_per_step]]
    engine = make_engine(policy_dir, r, seed=cfg.seed)
    try:
        roll = engine.generate(prompts, n=int(r.group_size), temperature=r.temperature, top_p=r.top_p,
                               max_new_tokens=int(r.max_new_tokens), seed=7)
    finally:
        engine.close()
    steps = {k: learner_step(Learner(policy_dir, objective=OBJECTIVES.get(c.algorithm.objective), learner_cfg=c.learner,
                                     algo_cfg=c.algorithm, temperature=r.temperature, seed=c.seed,
                                     max_completion_len=int(r.max_new_tokens)), roll, tok.pad_token_id)[0]
             for k, c in cfgs.items()}
    on, off = interleave(steps["on"], steps["off"], reps)
    P = max(len(p) for p in roll.prompt_ids)
    T = max(len(c) for c in roll.completion_ids)
    return {"on": on, "off": off, "threads": threads, "rows": len(roll.completion_ids), "prompts": len(prompts),
            "P": P, "T": T}


def bench_phases(cfg, policy_dir: Path, task, reps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench_sync import measure_sync
    from grpo_lab.learner.batch import collate, encode_prompt
    from grpo_lab.learner.learner import Learner
    from grpo_lab.objectives import OBJECTIVES
    from grpo_lab.rollout import make_engine
    from grpo_lab.run_setup import set_learner_threads

    threads = set_learner_threads(cfg)   # the trainer's own thread rule
    tok = AutoTokenizer.from_pretrained(str(policy_dir))
    r, t = cfg.rollout, cfg.trainer
    G, max_new = int(r.group_size), int(r.max_new_tokens)
    prompts = [encode_prompt(tok, it.prompt) for it in task.splits["train"][:t.prompts_per_step]]
    engine = make_engine(policy_dir, r, seed=cfg.seed)
    out: dict = {"threads": threads, "sequences": len(prompts) * G}
    try:
        # 1. rollout wrapper vs raw vLLM
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        seed = [100]

        def lab():
            seed[0] += 1
            engine.generate(prompts, n=G, temperature=r.temperature, top_p=r.top_p, max_new_tokens=max_new, seed=seed[0])

        def raw():
            seed[0] += 1
            params = [SamplingParams(n=G, temperature=r.temperature, top_p=r.top_p, max_tokens=max_new, logprobs=0,
                                     seed=seed[0] + i) for i in range(len(prompts))]
            engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

        out["rollout"] = interleave(lab, raw, reps)

        # 2. learner vs plain torch loop, on one real rollout of the start model
        roll = engine.generate(prompts, n=G, temperature=r.temperature, top_p=r.top_p, max_new_tokens=max_new, seed=7)
        learner = Learner(policy_dir, objective=OBJECTIVES.get(cfg.algorithm.objective), learner_cfg=cfg.learner,
                          algo_cfg=cfg.algorithm, temperature=r.temperature, seed=cfg.seed, max_completion_len=max_new)
        lab_learn, adv = learner_step(learner, roll, tok.pad_token_id)

        plain = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
        opt = torch.optim.AdamW(plain.parameters(), lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay)
        mb = int(cfg.learner.micro_batch_size)

        def plain_loop():
            # The same work by hand: forward, logprobs of the completion tokens, -A·logπ token mean,
            # backward per micro-batch (gradients accumulated), one AdamW step.
            batch = collate(roll.prompt_ids, roll.completion_ids, tok.pad_token_id, roll.sampler_logprobs)
            P, T = batch.prompt_width, batch["completion_ids"].shape[1]
            n_tok = batch["response_mask"].sum()
            opt.zero_grad(set_to_none=True)
            for i in range(0, len(batch), mb):
                sl = slice(i, i + mb)
                logits = plain(input_ids=batch["input_ids"][sl], attention_mask=batch["attention_mask"][sl],
                               position_ids=batch["position_ids"][sl], use_cache=False).logits[:, P - 1:P - 1 + T]
                lp = torch.log_softmax(logits.float() / r.temperature, -1).gather(
                    -1, batch["completion_ids"][sl].unsqueeze(-1)).squeeze(-1)                      # [mb, T]
                loss = -(adv[sl] * lp * batch["response_mask"][sl]).sum() / n_tok
                loss.backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.learner.grad_clip or float("inf"))
            opt.step()

        out["learner"] = interleave(lab_learn, plain_loop, reps)

        # 3. weight push: old vs new protocol, on the same engine and the learner's own tensors
        res = measure_sync(engine, learner.weights_for_sync(), ["pickle", "cpu"], reps)
        out["sync"] = (res["cpu"]["all_s"], res["pickle"]["all_s"])
    finally:
        engine.close()
    return out


# ------------------------------------------------------------------------------------- rows 4-5
def run_train(overrides: list[str], run_dir: Path, timeout: int = 3600) -> list[dict]:
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "grpo_lab.train", "logger=none", "hydra/job_logging=none",
           "hydra/hydra_logging=none", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"grpo_lab.train failed ({' '.join(overrides)}):\n{proc.stderr[-3000:]}")
    return [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines() if s.strip()]


def step_times(lines: list[dict]) -> list[float]:
    return [m["perf/step_time_s"] for m in lines if "perf/step_time_s" in m]


def bench_overlap(cfg, overrides: list[str], steps: int, reps: int, tmp: Path) -> dict | str:
    """Median step time of the synchronous loop and of the overlapped one (max_staleness=1): in this
    process, with the engine in a child process (trainer.backend=engine_process) and as a Ray actor
    (trainer.backend=ray, when ray is installed), in rotating order. In one process vLLM's client
    (request fan-out, output and logprob processing) shares the interpreter with the learner; in a
    child process or an actor it does not."""
    if "max_staleness" not in cfg.trainer:
        return "not available (trainer.max_staleness missing)"
    base = [*overrides, f"trainer.total_steps={steps}", "trainer.eval_every=0", "trainer.save_checkpoint=false"]
    settings = {"sync": ["trainer.max_staleness=0"], "overlap": ["trainer.max_staleness=1"],
                "overlap_child": ["trainer.max_staleness=1", "trainer.backend=engine_process"]}
    if importlib.util.find_spec("ray") is not None:
        settings["overlap_ray"] = ["trainer.max_staleness=1", "trainer.backend=ray"]
    times: dict[str, list[float]] = {k: [] for k in settings}
    names = list(settings)
    for r in range(reps):
        for k in names[r % len(names):] + names[:r % len(names)]:
            lines = run_train([*base, *settings[k]], tmp / f"overlap_{k}_{r}")
            times[k].append(med(step_times(lines)[1:]))  # first step: warm-up
    return times


def bench_learner_flag(cfg, overrides: list[str], flag: str, steps: int, reps: int, tmp: Path, task) -> dict:
    """learner.<flag>=true ("on") vs false ("off"): the same runs otherwise, alternating order; median
    learner phase and step (step 1, the warm-up, left out), mean silent-row share, and the final
    models' held-out greedy accuracy."""
    from transformers import AutoTokenizer

    from grpo_lab.prompts import prepare_for_model

    base = [*overrides, f"trainer.total_steps={steps}", "trainer.eval_every=0", "trainer.save_checkpoint=true"]
    out = {k: {"learn": [], "step": [], "silent": [], "acc": []} for k in ("on", "off")}
    test = task.splits[cfg.trainer.eval_split]
    tok = None
    for r in range(reps):
        for k in (("on", "off") if r % 2 == 0 else ("off", "on")):
            run_dir = tmp / f"{flag}_{k}_{r}"
            lines = run_train([*base, f"learner.{flag}={k == 'on'}"], run_dir)[1:]  # step 1: warm-up
            steps_only = [m for m in lines if "perf/learn_s" in m]
            out[k]["learn"].append(med([m["perf/learn_s"] for m in steps_only]))
            out[k]["step"].append(med([m["perf/step_time_s"] for m in steps_only]))
            out[k]["silent"].append(statistics.mean(m["actor/rows_without_gradient_frac"] for m in steps_only))
            final = run_dir / "checkpoints" / "final"
            tok = tok or prepare_for_model(task, AutoTokenizer.from_pretrained(str(final)), cfg.task)
            out[k]["acc"].append(evaluate_dir(final, test, int(cfg.rollout.max_new_tokens), tok)[0])
    return out


def accuracies(ab: dict, steps: int) -> str:
    return ("held-out greedy accuracy (test split) on " + ", ".join(f"{a:.1%}" for a in ab["on"]["acc"]) + " vs off "
            + ", ".join(f"{a:.1%}" for a in ab["off"]["acc"]) + f" ({steps}-step runs)")


def ensure_trl_venv() -> Path | str:
    """The TRL venv (built once, pinned); a string says why there is none."""
    py = TRL_VENV / "bin" / "python"
    check = [str(py), "-c", "import peft, trl, sys; sys.exit(0 if trl.__version__ == '1.16.0' else 1)"]
    if py.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return py
    import torch
    # The lock of the stack .venv holds (scripts/setup_env.sh), and its torch: 2.13.0+cpu or the CUDA 2.13.0.
    lock = REPO / f"requirements-{'cuda' if torch.version.cuda else 'cpu'}.lock"
    torch_pin = next(line for line in lock.read_text().splitlines() if line.lower().startswith("torch=="))
    print(f"[bench] building {TRL_VENV} ({TRL_PIN}, torch from {lock.name}; a few minutes) ...",
          file=sys.stderr, flush=True)
    # A venv from the base interpreter: the project's .venv must not leak into TRL's (no
    # --system-site-packages); torch (and peft, for LoRA recipes) pinned through the lock file. pip runs
    # as `python -m pip`: a venv moved on disk keeps a working interpreter but stale script shebangs.
    steps = [[getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(TRL_VENV)],
             [str(py), "-m", "pip", "install", "-q", "-c", str(lock), TRL_PIN,
              torch_pin, "transformers", "accelerate", "datasets", "peft"]]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return f"could not build the TRL venv ({' '.join(cmd[:4])} ...): {proc.stderr.strip()[-300:]}"
    if subprocess.run(check, capture_output=True).returncode != 0:
        return "the TRL venv does not import trl 1.16.0 and peft"
    return py


def evaluate_dir(model_dir: Path, items, max_new: int, tok) -> tuple[float, list[str]]:
    """Greedy accuracy of the model in `model_dir` on `items` and its completions; `tok` renders the
    prompts (the run's configured tokenizer: chat template, system prompt)."""
    from grpo_lab.evaluation import evaluate
    from grpo_lab.learner.batch import encode_prompt
    from grpo_lab.rollout.hf_engine import HFEngine

    engine = HFEngine.from_dir(model_dir)
    acc = evaluate(engine, tok, items, max_new_tokens=max_new)["eval/accuracy"]
    texts = engine.generate([encode_prompt(tok, it.prompt) for it in items], n=1, temperature=0.0, top_p=1.0,
                            max_new_tokens=max_new, seed=0, logprobs=False).texts
    return acc, texts


def trl_prompts(tok, items) -> list | str:
    """The prompts TRL must be given to see exactly the ids the lab's engine gets (checked on the first
    item): the chat conversation for a chat-template model (TRL applies the template with
    add_generation_prompt=True, as the lab does), else the bos token's text + the prompt text (TRL
    tokenizes a plain prompt as is). A string says why neither renders the lab's ids."""
    from grpo_lab.prompts import chat_messages, encode_prompt, uses_chat_template

    lab_ids = encode_prompt(tok, items[0].prompt)
    if uses_chat_template(tok):
        out = tok.apply_chat_template(chat_messages(tok, items[0].prompt), add_generation_prompt=True,
                                      tokenize=True, return_dict=True)
        if list(out["input_ids"]) != lab_ids:
            return "skipped: TRL's chat-template rendering differs from the lab's prompt ids"
        return [chat_messages(tok, it.prompt) for it in items]
    bos = tok.bos_token or ""
    if tok.encode(bos + items[0].prompt, add_special_tokens=False) != lab_ids:
        return "skipped: the tokenizer does not render bos + prompt text as the lab's prompt ids"
    return [bos + it.prompt for it in items]


def bench_trl(cfg, overrides: list[str], policy_dir: Path, task, steps: int, tmp: Path, reps: int = 1) -> dict | str:
    """The lab's run and TRL's GRPOTrainer on the same start model, prompts and settings, `reps` pairs in
    alternating order (TRL first, then the lab first, ...): RL-phase seconds of each, and held-out greedy
    accuracy of the first pair's final models (seeded runs: later pairs train the same models)."""
    from transformers import AutoTokenizer

    from grpo_lab.prompts import prepare_for_model
    from grpo_lab.rewards import extract_answer, is_correct

    py = ensure_trl_venv()
    if isinstance(py, str):
        return py
    tok = prepare_for_model(task, AutoTokenizer.from_pretrained(str(policy_dir)), cfg.task)
    t, r, lc = cfg.trainer, cfg.rollout, cfg.learner
    train = task.splits["train"][:steps * t.prompts_per_step]
    prompts = trl_prompts(tok, train)
    if isinstance(prompts, str):
        return prompts
    # Same learner settings as the lab's run: LoRA (peft, same rank/alpha/targets) or full fine-tuning,
    # bf16 autocast over fp32 masters or fp32, the lab's torch threads.
    lora = ({"rank": int(lc.lora.rank), "alpha": float(lc.lora.alpha), "dropout": float(lc.lora.dropout),
             "target_modules": list(lc.lora.target_modules)} if lc.lora.rank else None)
    spec = {"model_dir": str(policy_dir), "prompts": prompts, "answers": [it.answer for it in train],
            "answer_formats": [it.fields.get("answer_format", "plain") for it in train],
            "answers_module": str(REPO / "grpo_lab" / "rewards" / "answers.py"),
            "group_size": int(r.group_size), "prompts_per_step": int(t.prompts_per_step), "steps": steps,
            "lr": float(lc.lr), "grad_clip": float(lc.grad_clip), "temperature": float(r.temperature),
            "clip": float(cfg.algorithm.clip_low), "max_new_tokens": int(r.max_new_tokens), "seed": int(cfg.seed),
            "lora": lora, "bf16": lc.dtype == "bf16", "threads": int(lc.num_threads or 0),
            "out_dir": None, "result": None}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run_trl(k: int) -> dict | str:
        spec.update(out_dir=str(tmp / f"trl_{k}"), result=str(tmp / f"trl_{k}.json"))
        (tmp / "trl_spec.json").write_text(json.dumps(spec))
        proc = subprocess.run([str(py), str(REPO / "scripts" / "bench_trl_child.py"), str(tmp / "trl_spec.json")],
                              env={**env, "TOKENIZERS_PARALLELISM": "false"}, capture_output=True, text=True)
        if proc.returncode != 0:
            return f"TRL run failed: {proc.stderr.strip()[-1500:]}"
        return json.loads(Path(spec["result"]).read_text())

    def run_lab(k: int) -> list[float]:
        return step_times(run_train([*overrides, f"trainer.total_steps={steps}", "trainer.eval_every=0",
                                     "trainer.save_checkpoint=true"], tmp / f"lab_run_{k}"))

    trl_runs, lab_runs = [], []
    for k in range(reps):
        for side in (("trl", "lab") if k % 2 == 0 else ("lab", "trl")):
            if side == "lab":
                lab_runs.append(run_lab(k))
                continue
            res = run_trl(k)
            if isinstance(res, str):
                return res
            trl_runs.append(res)
    test = task.splits[t.eval_split]
    lab_acc, lab_texts = evaluate_dir(tmp / "lab_run_0" / "checkpoints" / "final", test, int(r.max_new_tokens), tok)
    trl_acc, trl_texts = evaluate_dir(tmp / "trl_0" / "final", test, int(r.max_new_tokens), tok)
    start_acc, _ = evaluate_dir(policy_dir, test, int(r.max_new_tokens), tok)
    # The TRL child's reward (the item's answer read by grpo_lab/rewards/answers.py, exact match) must
    # equal the lab's correctness on what the models write.
    agree = [is_correct(c, it) == (extract_answer(c, it.fields.get("answer_format", "plain")) == it.answer.strip())
             for c, it in zip(lab_texts + trl_texts, test + test)]
    lab_rl, trl_rl = [sum(x) for x in lab_runs], [x["rl_s"] for x in trl_runs]
    return {"lab_rl_s": lab_rl, "trl_rl_s": trl_rl, "trl_threads": trl_runs[0]["threads"],
            "pair_ratios": [a / b for a, b in zip(lab_rl, trl_rl)],
            "lab_step_s": med([med(x) for x in lab_runs]),
            "trl_step_s": med([med(x["step_s"]) for x in trl_runs if x["step_s"]]),
            "lab_acc": lab_acc, "trl_acc": trl_acc, "start_acc": start_acc, "n_test": len(test),
            "reward_agreement": sum(agree) / max(len(agree), 1)}


# ------------------------------------------------------------------------------------- report
def row(name: str, a: list[float], b: list[float], la: str, lb: str, target: str) -> str:
    ma, mb = med(a), med(b)
    return f"{name:<10}{la:<34}{1000 * ma:>10.1f}  {lb:<30}{1000 * mb:>10.1f}{ma / mb:>9.2f}x   {target}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions per A/B pair (default 7)")
    parser.add_argument("--steps", type=int, default=150, help="RL steps of the lab vs TRL runs (default 150)")
    parser.add_argument("--trl-reps", type=int, default=1,
                        help="lab/TRL run pairs, alternating which runs first (default 1; identical runs vary 15 %%+)")
    parser.add_argument("--overlap-steps", type=int, default=20, help="steps per overlap run (default 20)")
    parser.add_argument("--overlap-reps", type=int, default=2, help="runs per overlap setting (default 2)")
    parser.add_argument("--ab-steps", "--skip-steps", dest="ab_steps", type=int, default=150,
                        help="steps per run of the learner-flag rows, skip rows and shared (default 150)")
    parser.add_argument("--ab-reps", "--skip-reps", dest="ab_reps", type=int, default=2,
                        help="runs per setting of the learner-flag rows (default 2)")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["phases", "overlap", "skip_rows", "shared_prompts", "trl"])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (default: the default run)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_MODE", "offline")
    import torch

    from grpo_lab.tasks import build_task
    from grpo_lab.run_setup import build_policy

    cfg = compose(args.overrides)
    task = build_task(cfg.task)
    print("[bench] start model (tiny model + warm-up SFT, cached) ...", file=sys.stderr, flush=True)
    policy_dir, _ = build_policy(cfg, task, torch.device("cpu"))
    lines = []
    with tempfile.TemporaryDirectory(prefix="grpo_lab_bench_") as tmp:
        tmp = Path(tmp)
        if "phases" not in args.skip:
            print("[bench] rollout / learner / sync ...", file=sys.stderr, flush=True)
            ph = bench_phases(cfg, policy_dir, task, args.reps)
            ra, rb = ph["rollout"]
            la, lb = ph["learner"]
            sa, sb = ph["sync"]
            step_new = med(ra) + med(la) + med(sa)
            step_old = med(ra) + med(la) + med(sb)
            lines += [f"phases: {ph['sequences']} sequences per step, learner torch threads {ph['threads']}",
                      row("rollout", ra, rb, "VLLMEngine.generate ms", "raw vllm.LLM.generate ms", "target <= 1.05x"),
                      row("learner", la, lb, "Learner.score+update ms", "plain torch fwd/bwd/AdamW ms", "target <= 1.10x"),
                      row("sync", sa, sb, "new push (shm buckets) ms", "old push (pickled) ms", ""),
                      f"{'':<10}sync share of the step (rollout + learner + push): new {100 * med(sa) / step_new:.1f} % "
                      f"of {1000 * step_new:.0f} ms, old {100 * med(sb) / step_old:.1f} % of {1000 * step_old:.0f} ms "
                      "(target <= 5 %)"]
        if "overlap" not in args.skip:
            print("[bench] synchronous vs overlapped loop ...", file=sys.stderr, flush=True)
            ov = bench_overlap(cfg, args.overrides, args.overlap_steps, args.overlap_reps, tmp)
            if isinstance(ov, str):
                lines.append(f"{'overlap':<10}{ov}")
            else:
                lines.append(row("overlap", ov["overlap"], ov["sync"], "max_staleness=1 step ms",
                                 "max_staleness=0 step ms", "target <= 0.71x (>= 1.4x faster)"))
                lines.append(row("", ov["overlap_child"], ov["sync"], "... engine in a child process step ms",
                                 "max_staleness=0 step ms", "(trainer.backend=engine_process)"))
                if "overlap_ray" in ov:
                    lines.append(row("", ov["overlap_ray"], ov["sync"], "... engine as a Ray actor step ms",
                                     "max_staleness=0 step ms", "(trainer.backend=ray)"))
        if "skip_rows" not in args.skip:
            print("[bench] rows without gradient skipped vs trained ...", file=sys.stderr, flush=True)
            sk = bench_learner_flag(cfg, args.overrides, "skip_rows_without_gradient", args.ab_steps, args.ab_reps,
                                    tmp, task)
            lines += [row("skip rows", sk["on"]["learn"], sk["off"]["learn"], "silent rows skipped: learner ms",
                          "every row trained: learner ms", "learner.skip_rows_without_gradient"),
                      row("", sk["on"]["step"], sk["off"]["step"], "... step ms", "... step ms", ""),
                      f"{'':<10}rows without gradient {100 * statistics.mean(sk['off']['silent']):.1f} % of the "
                      f"learner's rows; " + accuracies(sk, args.ab_steps)]
        if "shared_prompts" not in args.skip:
            print("[bench] shared prompt forwards vs whole rows ...", file=sys.stderr, flush=True)
            sp = bench_learner_flag(cfg, args.overrides, "shared_prompt_forward", args.ab_steps, args.ab_reps, tmp, task)
            one = bench_shared_learner(args.overrides, policy_dir, task, args.reps)
            lines += [row("shared", sp["on"]["learn"], sp["off"]["learn"], "prompt forward shared: learner ms",
                          "every row whole: learner ms", "learner.shared_prompt_forward"),
                      row("", sp["on"]["step"], sp["off"]["step"], "... step ms", "... step ms", ""),
                      f"{'':<10}" + accuracies(sp, args.ab_steps),
                      row("", one["on"], one["off"], "... one fixed rollout: learner ms", "learner ms",
                          f"{one['rows']} rows of {one['prompts']} prompts, P {one['P']}, T {one['T']}, "
                          f"{one['threads']} threads")]
        if "trl" not in args.skip:
            print(f"[bench] lab vs TRL, {args.steps} steps each ...", file=sys.stderr, flush=True)
            tr = bench_trl(cfg, args.overrides, policy_dir, task, args.steps, tmp, args.trl_reps)
            if isinstance(tr, str):
                lines.append(f"{'TRL':<10}{tr}")
            else:
                lab_rl, trl_rl = med(tr["lab_rl_s"]), med(tr["trl_rl_s"])
                lines += [f"{'TRL':<10}{'lab RL phase s':<34}{lab_rl:>10.1f}  {'TRL GRPOTrainer.train() s':<30}"
                          f"{trl_rl:>10.1f}{lab_rl / trl_rl:>9.2f}x   target <= 0.50x",
                          f"{'':<10}{len(tr['pair_ratios'])} pairs, alternating order: lab "
                          f"{', '.join(f'{x:.1f}' for x in tr['lab_rl_s'])} s; TRL "
                          f"{', '.join(f'{x:.1f}' for x in tr['trl_rl_s'])} s; ratio per pair "
                          f"{', '.join(f'{x:.2f}' for x in tr['pair_ratios'])}",
                          f"{'':<10}{'median step s':<34}{tr['lab_step_s']:>10.2f}  {'':<30}{tr['trl_step_s']:>10.2f}",
                          f"{'':<10}held-out greedy accuracy ({tr['n_test']} test items, grpo_lab.evaluation.evaluate): "
                          f"start {tr['start_acc']:.1%}, lab {tr['lab_acc']:.1%}, TRL {tr['trl_acc']:.1%}; "
                          f"TRL threads {tr['trl_threads']}; reward functions agree on "
                          f"{tr['reward_agreement']:.0%} of evaluated completions"]
    print(f"\nbench ({args.reps} interleaved reps, medians; ratio = lab / baseline; overrides: "
          f"{' '.join(args.overrides) or '(default run)'})")
    head = f"{'row':<10}{'lab':<34}{'':>10}  {'baseline':<30}{'':>10}{'ratio':>10}"
    print(head)
    print("-" * 120)
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
