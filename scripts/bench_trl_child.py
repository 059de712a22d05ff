"""TRL `GRPOTrainer` on the lab's task, run by scripts/bench.py inside its own venv (.cache/trl_venv).

Imports only TRL's stack (no grpo_lab: its dependencies are not in that venv). Reads a JSON spec
written by bench.py (model dir, train prompts + answers, G, prompts per step, steps, lr, ...),
trains, saves the final model and writes {"rl_s": seconds of trainer.train()} to spec["result"].
The reward is exact match of the stripped completion with the answer, the lab's `correctness` on
this task's compact items (bench.py checks that the two agree on the evaluated completions).
"""

import json
import sys
import time


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(spec["seed"])
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    data = Dataset.from_list([{"prompt": p, "answer": a} for p, a in zip(spec["prompts"], spec["answers"])])

    def reward(completions, answer, **_):
        return [1.0 if c.strip() == a.strip() else 0.0 for c, a in zip(completions, answer)]

    G, P = spec["group_size"], spec["prompts_per_step"]
    cfg = GRPOConfig(
        output_dir=spec["out_dir"], per_device_train_batch_size=G * P, num_generations=G,
        gradient_accumulation_steps=1, max_steps=spec["steps"], learning_rate=spec["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo",  # token mean over the batch, as the lab's default
        temperature=1.0, top_p=1.0, max_completion_length=spec["max_new_tokens"],
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=10 ** 6,
        seed=spec["seed"], disable_tqdm=True, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok)
    t0 = time.perf_counter()
    trainer.train()
    rl_s = time.perf_counter() - t0
    trainer.model.save_pretrained(spec["out_dir"] + "/final")
    tok.save_pretrained(spec["out_dir"] + "/final")
    open(spec["result"], "w").write(json.dumps({"rl_s": rl_s, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
