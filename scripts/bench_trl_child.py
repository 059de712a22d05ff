"""TRL `GRPOTrainer` on the lab's task, run by scripts/bench.py inside its own venv (.cache/trl_venv).

Imports only TRL's stack, plus grpo_lab/rewards/answers.py loaded by its path (pure Python, `re`
only), so both sides read answers by one rule. Reads a JSON spec written by bench.py (model dir,
train prompts + answers + answer formats, G, prompts per step, steps, lr, temperature, LoRA, bf16,
...), trains, saves the final model (LoRA merged into the base, as the lab's checkpoint) and writes
{"rl_s": seconds of trainer.train(), "step_s": [seconds per optimizer step]} to spec["result"].
The reward is 1.0 when the answer read from the completion equals the item's answer: the lab's
`correctness` on these items (bench.py checks that the two agree on the evaluated completions).
"""

import importlib.util
import json
import sys
import time


def load_answers(path: str):
    spec = importlib.util.spec_from_file_location("grpo_lab_answers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(spec["seed"])
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    answers = load_answers(spec["answers_module"])
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    data = Dataset.from_list([{"prompt": p, "answer": a, "answer_format": f}
                              for p, a, f in zip(spec["prompts"], spec["answers"], spec["answer_formats"])])

    def reward(completions, answer, answer_format, **_):
        # Conversational prompts give conversational completions: [{"role": "assistant", "content": ...}].
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [1.0 if answers.extract_answer(t, f) == a.strip() else 0.0
                for t, a, f in zip(texts, answer, answer_format)]

    peft_config = None
    if spec.get("lora"):
        from peft import LoraConfig

        lo = spec["lora"]
        peft_config = LoraConfig(r=lo["rank"], lora_alpha=lo["alpha"], lora_dropout=lo["dropout"],
                                 target_modules=lo["target_modules"], bias="none", task_type="CAUSAL_LM")

    class StepTimes(TrainerCallback):
        """Wall time of each optimizer step (generation, reward, forward/backward, update)."""

        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    G, P = spec["group_size"], spec["prompts_per_step"]
    cfg = GRPOConfig(
        output_dir=spec["out_dir"], per_device_train_batch_size=G * P, num_generations=G,
        gradient_accumulation_steps=1, max_steps=spec["steps"], learning_rate=spec["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=spec.get("grad_clip", 1.0),
        beta=0.0, num_iterations=1, epsilon=spec.get("clip", 0.2),
        loss_type="dapo",  # token mean over the batch, as the lab's default
        temperature=spec.get("temperature", 1.0), top_p=1.0, max_completion_length=spec["max_new_tokens"],
        use_cpu=True, bf16=bool(spec.get("bf16")), report_to="none", save_strategy="no", logging_steps=10 ** 6,
        seed=spec["seed"], disable_tqdm=True, dataloader_num_workers=0)
    steps = StepTimes()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                          peft_config=peft_config, callbacks=[steps])
    t0 = time.perf_counter()
    trainer.train()
    rl_s = time.perf_counter() - t0
    final = trainer.model.merge_and_unload() if peft_config is not None else trainer.model
    final.save_pretrained(spec["out_dir"] + "/final")
    tok.save_pretrained(spec["out_dir"] + "/final")
    open(spec["result"], "w").write(json.dumps({"rl_s": rl_s, "step_s": steps.times,
                                                "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
