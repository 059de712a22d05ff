"""The memory planner's per-device prediction for PPO (critic + GAE) vs GRPO, RLOO and GSPO, from configs
alone (grpo_lab/memory_plan.py; no model loads), as a Markdown table.

    python scripts/plan_algorithms.py                 # Qwen2.5-1.5B and -7B, full and LoRA, 1 x H200 and 8 x H100
    python scripts/plan_algorithms.py --smollm2-only  # the SmolLM2 recipe on this machine, as benched
                                                      # (rollout.gpu_memory_utilization=0.16)

Rows at scale start from conf/experiment/gpu_algorithms.yaml (bf16 over fp32 master weights, gradient
checkpointing, logits in 2048-token chunks, 128 prompts x G 8 of up to 4096 tokens, micro-batches of 8
sequences, vLLM colocated at 0.4 of the device) with the model swapped; LoRA rows add rank 64 on every
linear projection. "8 x H100" plans FSDP-style sharding over 8 ranks of 80 GB (learner.num_devices=8).
Each algorithm keeps its own recipe (conf/algorithm/*.yaml), so the KL coefficient decides whether a
reference is held: ppo (beta 0.001) and rloo (0.05) hold one, grpo and gspo (beta 0) do not; under LoRA the
reference is the base with adapters disabled (no copy). "learner total" leaves out the rollout engine's
share; ratios divide by the ppo row of the same setting.

The plan books PPO's critic like the policy: 18 B/parameter in bf16 (fp32 master, bf16 copy, gradients,
AdamW), with its activations assumed smaller than the policy's. The learner as written runs the critic
(ValueModel) outside autocast and without gradient checkpointing, so its forward stores fp32
activations of every layer: "critic act. as run" is the planner's own activation formula for that
(learner.dtype=fp32, gradient_checkpointing=false, same micro-batch), and "learner as run" swaps it in for
the policy's activations and logits where it is larger, with the critic at 16 B/parameter (no bf16 copy).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hydra import compose, initialize_config_dir

from grpo_lab.config import finalize, register_configs
from grpo_lab.memory_plan import GB, plan_memory

CONF = Path(__file__).resolve().parents[1] / "conf"
ALGORITHMS = ["ppo", "grpo", "rloo", "gspo"]
LORA = ["learner.lora.rank=64", "learner.lora.alpha=128"]
MACHINES = {"1 x H200": ["learner.num_devices=1", "learner.device_memory_gb=141"],
            "8 x H100": ["learner.num_devices=8", "learner.device_memory_gb=80"]}
SMOLLM2_ENGINE_SHARE = 0.16
SCALE_MODELS = {"Qwen2.5-1.5B": "/models/Qwen2.5-1.5B", "Qwen2.5-7B": "/models/Qwen2.5-7B"}


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=overrides))


def settings(smollm2_only: bool) -> list[tuple[str, str, str, list[str], bool]]:
    """(model, tuning, machine, overrides, plan against this machine) for every setting to plan."""
    # As benched: vLLM's CPU worker sizes its KV cache as gpu_memory_utilization x its NUMA node's memory
    # minus its own resident set, which the recipe's 0.05 no longer covers on a 15 GiB node; 0.16 gives it
    # back about the recipe's 1.2 GB of KV cache (tables/notes/critic_costs.md).
    out = [("SmolLM2-135M", "LoRA r16", "this CPU", ["experiment=smollm2_chain_sum", "learner.device=cpu",
                                                     f"rollout.gpu_memory_utilization={SMOLLM2_ENGINE_SHARE}"], True)]
    if smollm2_only:
        return out
    for model, path in SCALE_MODELS.items():
        for tuning, extra in (("full", []), ("LoRA r64", LORA)):
            for machine, devices in MACHINES.items():
                out.append((model, tuning, machine,
                            ["experiment=gpu_algorithms", f"model.path={path}", *devices, *extra], False))
    return out


def plan_row(overrides: list[str], machine: bool) -> dict:
    cfg = compose_cfg(overrides)
    plan = plan_memory(cfg, machine=machine)
    engine = sum(i.bytes for i in plan.items if i.name.startswith("rollout engine"))
    policy = sum(i.bytes for i in plan.items if i.name.startswith(("policy", "gradients", "AdamW", "LoRA")))
    row = {"policy": policy, "ref": plan.item("reference model"), "critic": plan.item("critic (+AdamW)"),
           "act": plan.item("activations") + plan.item("logits (fp32)"), "engine": engine,
           "total": plan.total, "learner": plan.total - engine, "fits": plan.fits, "critic_act": 0.0}
    row["as_run"] = row["learner"]
    if row["critic"]:
        fp32 = plan_memory(compose_cfg([*overrides, "learner.dtype=fp32", "learner.gradient_checkpointing=false"]),
                           machine=machine)
        row["critic_act"] = fp32.item("activations")
        critic_as_run = row["critic"] * (16 / 18 if cfg.learner.dtype == "bf16" else 1.0)   # no bf16 copy
        row["as_run"] = (row["learner"] - row["critic"] + critic_as_run - row["act"]
                         + max(row["act"], row["critic_act"]))
    return row


def table(smollm2_only: bool) -> str:
    head = ("| model | tuning | devices | algorithm | policy states GB | ref GB | critic GB | act+logits GB "
            "| engine GB | learner total GB | total GB / device | fits | total / ppo | learner / ppo "
            "| critic act. as run GB | learner as run GB | as run / ppo |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for model, tuning, machine, overrides, here in settings(smollm2_only):
        rows = {a: plan_row([*overrides, f"algorithm={a}"], here) for a in ALGORITHMS}
        base = rows["ppo"]
        for a, r in rows.items():
            g = lambda key: f"{r[key] / GB:.2f}"  # noqa: E731
            fits = {True: "yes", False: "NO", None: "?"}[r["fits"]]
            lines.append(f"| {model} | {tuning} | {machine} | {a} | {g('policy')} | {g('ref')} | {g('critic')} "
                         f"| {g('act')} | {g('engine')} | {g('learner')} | {g('total')} | {fits} "
                         f"| {r['total'] / base['total']:.2f} | {r['learner'] / base['learner']:.2f} "
                         f"| {g('critic_act')} | {g('as_run')} | {r['as_run'] / base['as_run']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2-only", action="store_true", help="only the SmolLM2 recipe on this machine")
    args = parser.parse_args()
    register_configs()
    print(table(args.smollm2_only))


if __name__ == "__main__":
    main()
