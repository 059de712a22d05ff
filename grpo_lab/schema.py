"""The typed schema of every run: one dataclass per config group, merged by Hydra into `Config`.

The YAML files under `conf/` hold the *values*; the dataclasses here hold the *types*. Hydra merges
each group's YAML into `Config` (stored as `base_config` by `grpo_lab.config.register_configs`), so a
misspelt key fails at start ("Key 'clip_lo' not in 'AlgorithmConfig'") and a wrong type fails with
OmegaConf's message. Value constraints that types cannot express are checked by
`grpo_lab.config.validate`. This module imports nothing of the lab, so every layer may read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


class ConfigError(ValueError):
    """A config value that cannot work; the message says what to change."""


@dataclass
class KLConfig:
    # KL(π || π_ref) coefficient β; 0 means no reference model is loaded at all.
    coef: float = 0.0
    # Estimator of the per-token KL (Schulman's k1, k2, k3; GRPO uses k3).
    estimator: str = "k3"
    # "loss": added to the policy loss (GRPO); "reward": subtracted from the token rewards (PPO, REINFORCE++).
    placement: str = "loss"
    # Load the reference and log KL(π || π_ref) of each step's samples (kl_ref/seq, kl_ref/token) whatever
    # the coefficient; null = when the reward is learned (reward.weights names reward_model), where the
    # gold-vs-KL curve is the question (grpo_lab/config.py finalize fills it in).
    track: Optional[bool] = None


@dataclass
class OverlongConfig:
    # Overlong filtering (DAPO §3.4): truncated completions are masked out of the loss.
    filter: bool = False
    # Soft overlong punishment (DAPO eq. 13): buffer length L_cache in tokens before max_new_tokens; 0 = off.
    soft_buffer: int = 0
    # Penalty at (and beyond) the maximum length.
    soft_penalty: float = 1.0


@dataclass
class DynamicSamplingConfig:
    # DAPO dynamic sampling: drop groups whose rewards all agree; resample prompts until the batch is full.
    enabled: bool = False
    # Cap on sampling rounds per step; exceeding it raises (the task is too easy or too hard for this policy).
    max_rounds: int = 8


@dataclass
class RolloutCorrectionConfig:
    # Correct for the rollout engine / learner mismatch (and a stale engine, trainer.max_staleness=1) with
    # weights from ρ_t = π_learner(y_t) / π_engine(y_t) (grpo_lab/algos/rollout_correction.py): null = off
    # (the loss's π_old is then the engine's logprobs); token (ρ_t each), sequence (Π_t ρ_t per answer) or
    # geometric (exp of the mean log ρ_t per answer). Works with every policy loss.
    level: Optional[str] = None
    # truncate: clamp each weight to [lower, upper] (TIS); mask: weight 0 for a token/answer outside them.
    mode: str = "truncate"
    # Upper bound, >= 1 (Yao et al.'s TIS cap 2; TRL's default 3).
    upper: float = 2.0
    # Lower bound in (0, 1]; null = none (e.g. 0.5 for verl's Seq-MIS, 0.999 for its geometric rejection).
    lower: Optional[float] = None


@dataclass
class CriticConfig:
    # Train a value model (PPO). Needed by the "gae" advantage estimator.
    enabled: bool = False
    # Learning rate of the critic's optimizer.
    lr: float = 1e-3
    # Clip range of the clipped value loss (PPO); value updates beyond old_value ± clip are not rewarded.
    value_clip: float = 0.2
    # Weight of the value loss (its own optimizer, so this only scales its gradient).
    coef: float = 1.0
    # A separate HF model directory for the critic's trunk; null = a copy of the policy's trunk.
    model_path: Optional[str] = None


@dataclass
class PreferenceConfig:
    # Registered preference loss (grpo_lab/algos/preference.py): dpo (arXiv 2305.18290) or ipo (2310.12036).
    loss: str = "dpo"
    # Registered pairing of a scored group: best_worst (one pair per group) or all_pairs (every ordered
    # pair with different rewards: "group DPO").
    pairing: str = "best_worst"
    # DPO temperature β.
    beta: float = 0.1
    # Weight group pairs by Bradley-Terry confidence σ(r_w − r_l).
    bt_weighting: bool = False
    # Where pairs come from: "policy" (the policy's own scored groups, each step), "start_policy" (a fixed
    # pool of the starting policy's groups, sampled and scored once: offline group preferences, e.g.
    # labelled by a learned reward model) or a local JSONL path with prompt/chosen/rejected fields.
    pairs: str = "policy"
    # Prompts in the start_policy pool (each with its group of rollout.group_size samples).
    pool_prompts: int = 1024
    # Preference-label noise: each formed pair (or each row of a pairs file, once, at load) has its
    # chosen and rejected swapped with this probability, seeded by the run's seed.
    label_flip_prob: float = 0.0
    # The known remedy for label noise: the assumed flip rate ε, read by loss=dpo as conservative DPO
    # (label smoothing, cDPO) and by loss=rdpo as robust DPO's unbiased correction (arXiv 2403.00409).
    label_smoothing: float = 0.0


@dataclass
class AlgorithmConfig:
    # Name used in run names and wandb job_type; the recipe file sets it.
    name: str = "grpo"
    # How the parts below are combined into a loss: "policy_gradient" (GRPO family, PPO) or "preference" (DPO).
    objective: str = "policy_gradient"
    # Registered advantage estimator (grpo_lab/algos/core.py).
    advantage: str = "group_zscore"
    # ε added to the group std in z-score advantages.
    adv_eps: float = 1e-6
    # Discount γ and GAE λ (token-level estimators only).
    gamma: float = 1.0
    lam: float = 1.0
    # Registered policy loss (grpo_lab/algos/core.py).
    policy_loss: str = "clipped_surrogate"
    # Clip range [1 − clip_low, 1 + clip_high]; clip_high > clip_low is DAPO's clip-higher.
    clip_low: float = 0.2
    clip_high: float = 0.2
    # Dual-clip constant c > 1 for negative advantages (arXiv 1912.09729); null = off.
    dual_clip: Optional[float] = None
    # CISPO (arXiv 2506.13585): the detached IS weight is clipped to [1 − cispo_clip_low, 1 + cispo_clip_high];
    # null = no lower bound (MiniMax-M1 sets ε_low^IS large and tunes only ε_high^IS).
    cispo_clip_low: Optional[float] = None
    # CISPO's ε_high^IS (verl's example 0.2; TRL's ε_max = 5 is cispo_clip_high = 4).
    cispo_clip_high: float = 0.2
    # GMPO (arXiv 2507.20673): each token's log-ratio is clipped to [−gmpo_log_clip_low, gmpo_log_clip_high]
    # (log space; the paper's 0.4 each is a ratio range (e^-0.4, e^0.4)), sign-aware as PPO's clip.
    gmpo_log_clip_low: float = 0.4
    gmpo_log_clip_high: float = 0.4
    # SAPO (arXiv 2511.20347): temperature τ of the soft gate σ(τ(r − 1))·4/τ for tokens with A > 0 / A ≤ 0
    # (paper 1.0 and 1.05: the gate decays faster for negative advantages).
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    # DPPO-Binary-TV (arXiv 2602.04879): drop a token's gradient when π − π_old > dppo_delta_high with A > 0,
    # or < −dppo_delta_low with A < 0 (a total-variation trust region; the released recipe uses 0.15 each).
    dppo_delta_low: float = 0.15
    dppo_delta_high: float = 0.15
    # DPPO: cap C of its detached ratio weight min(r, C) (the authors' code 10; verl's example 10000); null = none.
    dppo_ratio_cap: Optional[float] = 10.0
    # Loss aggregation mode (grpo_lab/algos/core.py).
    aggregation: str = "token_mean"
    # Updates per rollout batch: μ epochs × minibatches; the sampler's logprobs are π_old throughout.
    epochs: int = 1
    minibatches: int = 1
    kl: KLConfig = field(default_factory=KLConfig)
    # Entropy bonus coefficient (0 = only logged).
    entropy_coef: float = 0.0
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    # Rollout-engine / learner mismatch correction (token / sequence / geometric weights, truncated or masked).
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # Retired: replaced by rollout_correction (tis_cap=C is level=token mode=truncate upper=C); a value is refused.
    tis_cap: Optional[float] = None
    critic: CriticConfig = field(default_factory=CriticConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    # Running (EMA) reward normalisation decay; null = off.
    reward_ema_decay: Optional[float] = None
    # Best-of-group supervised anchor: NLL weight λ on each group's best completion (0 = off) ...
    sft_anchor_coef: float = 0.0
    # ... reached linearly over this many steps.
    sft_anchor_warmup: int = 0


@dataclass
class ModelConfig:
    # Registered model builder (grpo_lab/models): tiny_llama, smollm2_135m, pretrained.
    builder: str = "tiny_llama"
    # tiny_llama sizes (conf/model/tiny_llama.yaml sets them; null = not passed to the builder, as
    # for the pretrained builders, which take none).
    hidden_size: Optional[int] = None
    num_layers: Optional[int] = None
    num_heads: Optional[int] = None
    intermediate_size: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    tie_word_embeddings: Optional[bool] = None
    # pretrained: a local Hugging Face model directory.
    path: Optional[str] = None


@dataclass
class TaskConfig:
    # Task source: a registered one (grpo_lab/tasks: reasoning_gym, local_dataset) or a plug-in factory
    # "package.module:function" returning a grpo_lab.tasks.Task.
    source: str = "reasoning_gym"
    # reasoning-gym generator name (task.name=chain_sum) or a label for a local dataset.
    name: str = "chain_sum"
    # Extra arguments of the generator (reasoning_gym.create_dataset(name, **dataset_kwargs)); each
    # conf/task file sets its own, so switch tasks with task=<file> (task.name=... keeps these keys).
    dataset_kwargs: Dict[str, Any] = field(default_factory=dict)
    # "question" (generator text) or "compact" (short form for tiny character-level models).
    prompt_format: str = "question"
    # Items in the train split (RL prompts and warm-up data); >= 1.
    train_size: int = 20000
    # Items in the dev split (the warm-up's stopping rule); >= 1.
    dev_size: int = 200
    # Items in the test split (held-out evaluation); >= 1.
    test_size: int = 200
    # Split seeds; reasoning-gym seeds item i with seed + i, so they must be more than a split size apart.
    train_seed: int = 1_000_000
    # Seed of the dev split (see train_seed).
    dev_seed: int = 2_000_000
    # Seed of the test split (see train_seed).
    test_seed: int = 3_000_000
    # local_dataset: file (JSONL/JSON/parquet/CSV) or hub name.
    path: Optional[str] = None
    # local_dataset: field holding the prompt text.
    prompt_field: str = "prompt"
    # local_dataset: field holding the reference answer.
    answer_field: str = "answer"
    # local_dataset: field holding the SFT target (null = the answer).
    solution_field: Optional[str] = None
    # local_dataset: {split: file} when the data comes pre-split (e.g. {train: a.jsonl, test: b.jsonl}).
    # Untyped for the reason rollout.group_size_schedule is: a command-line dict cannot merge into a
    # null typed Dict node; check_local_dataset checks it instead.
    splits: Optional[Any] = None
    # How answers are written and extracted: plain (whole completion), hash ("#### 42"), tags
    # (<answer>42</answer>); null = the source's default.
    answer_format: Optional[str] = None
    # Template around each prompt, e.g. "Question: {prompt}\nAnswer:".
    prompt_template: str = "{prompt}"
    # Longest completion the task needs, in tokens (sets rollout.max_new_tokens by default).
    max_completion_tokens: int = 8
    # How prompts reach the model (grpo_lab/prompts.py): auto (its chat template if it has one), none, or a .jinja path.
    chat_template: str = "auto"
    # System message before each prompt when a chat template is used (null = the template's own default).
    system_prompt: Optional[str] = None
    # local_dataset from the hub: the dataset's configuration name (e.g. "main" for openai/gsm8k).
    hub_config: Optional[str] = None
    # Prompts too long for rollout.max_model_len (with rollout.max_new_tokens): false = refuse the run (the
    # error names the data and the count), true = drop those rows from every split and print how many.
    drop_overlong: bool = False
    # Refuse a train split with fewer distinct prompts than this and than half its items; 0 = train anyway, warned.
    min_distinct_train_prompts: int = 1000
    # Refuse when over 5 % of the test prompts also appear in dev; true = evaluate anyway, with a printed warning.
    allow_split_overlap: bool = False


@dataclass
class JudgeConfig:
    # Builder of the frozen judge model (grpo_lab.models.MODEL_BUILDERS): smollm2_135m, or pretrained + path.
    builder: str = "smollm2_135m"
    # builder=pretrained: the judge's local HF model directory.
    path: Optional[str] = None
    # Where built judge models are cached (one directory per builder, shared by all runs).
    cache_dir: str = "${cache_dir}/models"
    # Engine serving the judge (grpo_lab.rollout.ROLLOUT_ENGINES): vllm, or hf (transformers generate).
    engine: str = "vllm"
    # Judge prompt; {prompt}, {completion} and {answer} are replaced (grpo_lab/rewards/llm_judge.py).
    template: str = (
        "You are grading a student's answer to a question.\n\nQuestion: {prompt}\n\nReference answer: {answer}\n\n"
        "Student's response: {completion}\n\nIf the student's final answer agrees with the reference answer, reply "
        "'Score: 10/10'; if it does not, reply 'Score: 0/10'. Then give one sentence of feedback."
    )
    # How the judge prompt reaches the judge: auto (its chat template), none, or a .jinja path.
    chat_template: str = "auto"
    # System message for the judge (null = its template's default).
    system_prompt: Optional[str] = None
    # Text the judge's answer starts with (written for it), so even a small judge begins with its number.
    response_prefix: str = "Score:"
    # Scale of a bare "Score: N" (a written "N/M" uses M).
    score_max: float = 10.0
    # Tokens the judge may write (score + feedback); decoding is greedy.
    max_new_tokens: int = 48
    # Completions longer than this many characters are cut before judging (null = never).
    max_completion_chars: Optional[int] = 2000
    # Judge engine: context length.
    max_model_len: int = 2048
    # Judge engine (vLLM): share of device memory (CPU build: of RAM) for weights + KV cache (0.1 was too small for SmolLM2 here).
    gpu_memory_utilization: float = 0.25
    # Judge weights' dtype in the engine.
    dtype: str = "float32"
    # Seconds one judge generate call may run (null = no limit).
    generate_timeout_s: Optional[float] = 600.0


@dataclass
class RewardNoiseConfig:
    # Registered noise on the training reward (grpo_lab/rewards/noise.py): none, flip (1/0 rewards),
    # gaussian, judge_like. Evaluation always scores with the clean verifier.
    kind: str = "none"
    # flip: probability that a 1/0 reward is flipped.
    flip_prob: float = 0.0
    # gaussian and judge_like: std of the per-sample additive noise.
    std: float = 0.0
    # judge_like: std of the bias the judge holds for each prompt (fixed per prompt text).
    prompt_bias_std: float = 0.0
    # judge_like: reward added for a completion of rollout.max_new_tokens tokens (proportionally less
    # for shorter ones): the judge's preference for long answers.
    length_bias: float = 0.0


@dataclass
class RewardModelRewardConfig:
    """``reward.reward_model``: how reward=reward_model turns the learned reward models' scores into rewards
    (grpo_lab/rewards/reward_model.py)."""

    # Directories of trained reward models (what `python -m grpo_lab.train_reward_model` writes; several = an
    # ensemble). null = the run trains them itself from the top-level `reward_model` section (cached by content).
    dirs: Optional[List[str]] = None
    # Normalisation of the scores in each call: none | batch (z-score over the call's samples) | group (z-score
    # over each prompt's samples). A running z-score across steps is algorithm.reward_ema_decay (checkpointed).
    normalize: str = "none"
    # Clamp the (normalised) reward to [-clip, clip]; null = no clamp.
    clip: Optional[float] = None
    # How an ensemble's scores combine (Coste et al., arXiv 2310.02743): mean | min (worst case) |
    # mean_minus_std (uncertainty-weighted: mean - ensemble_std_coef * std).
    ensemble: str = "mean"
    ensemble_std_coef: float = 1.0
    # Rows per reward-model forward.
    batch_size: int = 64
    # The frozen models' weights while scoring: fp32 | bf16 (half the memory of each member, as verl and OpenRLHF
    # hold reward models; scores move by bf16 rounding). An online refresh (reward_model.refresh_every > 0)
    # trains its members in fp32 and so needs fp32 here.
    dtype: str = "fp32"


@dataclass
class RewardConfig:
    # Reward functions and their weights (weighted sum): a registered name (grpo_lab/rewards) or a
    # plug-in import path, e.g. +reward.weights={my_pkg.rewards.length_penalty: 0.5} (or "pkg.mod:fn").
    # Empty here: the reward group (conf/reward/*.yaml) names them. A default here would be merged
    # into every group's dict, silently adding correctness_binary to reward=scorer or llm_judge.
    weights: Dict[str, float] = field(default_factory=dict)
    # Seconds one reward-function call may run (null = no limit); timed-out samples get on_error.
    timeout_s: Optional[float] = 60.0
    # Reward given to a sample whose reward function raised, returned NaN/inf or timed out.
    on_error: float = 0.0
    # Fail the run when more than this fraction of a step's samples had a failed reward (0 = any).
    max_error_frac: float = 0.1
    # Fail the run when one reward's calls time out this many times in a row (its batch call, then
    # single samples): a reward that hangs on everything fails after 3 x timeout_s (null = no such rule).
    max_consecutive_timeouts: Optional[int] = 3
    # Where reward calls run: auto (a killable worker process for rewards that may hang: plug-ins, math_verify;
    # this process for the cheap built-ins), process (all in the worker), thread (all here: a hang in C code
    # or a sleep in the max_staleness=1 sampling thread cannot be interrupted). grpo_lab/rewards/isolation.py
    isolation: str = "auto"
    # The frozen judge model of reward llm_judge (read only when reward.weights names llm_judge).
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    # Controlled noise on the training reward, after the reward functions, before shaping and advantages.
    noise: RewardNoiseConfig = field(default_factory=RewardNoiseConfig)
    # The learned reward models of reward reward_model (read only when reward.weights names reward_model).
    reward_model: RewardModelRewardConfig = field(default_factory=RewardModelRewardConfig)


@dataclass
class RolloutConfig:
    # Engine behind the RolloutEngine protocol: "vllm" (real engine, CPU or CUDA build) or "hf" (transformers generate).
    engine: str = "vllm"
    # G: completions sampled per prompt.
    group_size: int = 8
    # Optional schedule {start_step: G} overriding group_size from each start step on (null = fixed G).
    # Untyped on purpose: OmegaConf cannot merge a command-line dict ({1:4,50:8}) into a null typed
    # Dict node, nor add keys to a struct one; validate() checks keys and values instead.
    group_size_schedule: Optional[Any] = None
    # Sampling temperature for training rollouts (evaluation is greedy).
    temperature: float = 1.0
    # Nucleus sampling threshold for training rollouts (1.0 = off).
    top_p: float = 1.0
    # Maximum completion length; completions that hit it are "truncated".
    max_new_tokens: int = "${task.max_completion_tokens}"  # type: ignore[assignment]
    # vLLM: fraction of device memory (on the CPU backend: of RAM) reserved for the KV cache.
    gpu_memory_utilization: float = 0.1
    # vLLM: KV cache size in bytes, e.g. 268435456 (256 MiB), instead of a share of memory (then
    # gpu_memory_utilization is ignored, and a busy machine's free memory no longer decides); null = the share.
    kv_cache_bytes: Optional[int] = None
    # vLLM: context length the engine allocates for.
    max_model_len: int = 256
    # vLLM: eager mode (no graph capture); required for fast start-up on CPU.
    enforce_eager: bool = True
    # Numeric type of the engine's weights (ROLLOUT_DTYPES: float32, bfloat16, float16); fp32 keeps
    # engine and learner logprobs within 1e-3.
    dtype: str = "float32"
    # vLLM: seconds one generate call (rollout or evaluation) may take before the run fails; null = no limit.
    generate_timeout_s: Optional[float] = 600.0
    # vLLM: seconds one weight push into the engine may take before the run fails (null = no limit).
    sync_timeout_s: Optional[float] = 300.0
    # vLLM weight push: auto | cpu (shared-memory buckets) | cuda_ipc (engine on the learner's GPU only) | nccl (engine on other GPUs) | pickle (old, bench baseline).
    sync_transport: str = "auto"
    # vLLM weight push: size of one flattened bucket in MiB (bounds the transient copy; a layer is never split).
    sync_bucket_mb: float = 256.0
    # vLLM weight push: send only tensors whose storage/version changed since the last push (whole fused layers).
    sync_changed_only: bool = True
    # vLLM: devices one engine's weights are split over (tensor parallelism; CPU: core groups).
    tensor_parallel_size: int = 1
    # Engine replicas, each with tensor_parallel_size devices of its own; a step's prompts are split
    # among them and new weights go to all (grpo_lab/rollout/data_parallel.py).
    data_parallel_size: int = 1
    # hf engine: "generate" (transformers generate on every row; the committed tables) or "shared_prefill"
    # (each distinct prompt's forward once, its G samples decode from its KV cache; same distribution).
    sampler: str = "generate"


@dataclass
class LoRAConfig:
    # LoRA rank r (arXiv 2106.09685) through peft; 0 = off (full fine-tuning).
    rank: int = 0
    # LoRA α: the update B·A is scaled by α / r.
    alpha: float = 16.0
    # Dropout on the adapter's input (0 = off; it also makes training-mode logprobs stochastic).
    dropout: float = 0.0
    # Module names that get adapters. Default: every linear projection of a Llama / Qwen2 / Mistral
    # block; the LoRA paper adapted only q_proj, v_proj, but attention-only LoRA learns less than
    # LoRA on the MLPs too ("LoRA Without Regret", Schulman et al., Thinking Machines 2025).
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])


# rollout.dtype's choices: torch dtype names every engine accepts (vLLM's `dtype`, torch.<name> for hf).
ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")

# rollout.sampler's choices, read by the hf engine (grpo_lab/rollout/hf_engine.py): one generate call over all
# prompts, or each prompt's prefix computed once and shared by its group's samples.
SAMPLERS = ("generate", "shared_prefill")

# learner.dtype's choices: fp32, or bf16 autocast over fp32 master weights.
LEARNER_DTYPES = ("fp32", "bf16")


@dataclass
class LearnerConfig:
    # AdamW learning rate of the policy.
    lr: float = 1e-4
    weight_decay: float = 0.0
    # Global gradient-norm clip (0 = off).
    grad_clip: float = 1.0
    # Sequences per forward/backward; a minibatch is split into micro-batches and gradients accumulated.
    micro_batch_size: int = 64
    # "cpu" or "cuda" ("auto" picks cuda when available).
    device: str = "auto"
    # torch CPU threads of the learner process; null = half the cores (the rollout engine's process
    # gets the rest): oversubscribed OpenMP threads spin against each other, so the two processes'
    # threads together should not exceed the cores.
    num_threads: Optional[int] = None
    # Compute dtype: "fp32", or "bf16" = bf16 autocast forward over fp32 master weights, fp32
    # gradients and fp32 AdamW state (mixed precision, arXiv 1710.03740).
    dtype: str = "fp32"
    # Recompute each decoder layer's activations in backward (HF gradient_checkpointing_enable,
    # use_reentrant=False): less activation memory for ~1 extra forward.
    gradient_checkpointing: bool = False
    # LoRA adapters (peft); rank 0 = full fine-tuning. With LoRA the reference is the base with adapters off.
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # Token budget per micro-batch: rows × padded width ≤ this (rows sorted by length, padding
    # trimmed per micro-batch); null = micro_batch_size sequences per micro-batch.
    max_tokens_per_micro_batch: Optional[int] = None
    # Leave out of the update's forward/backward the rows whose loss and gradient are exactly 0 by
    # construction (all-zero advantages: a group whose rewards agree; no token in the loss mask), as
    # the objective says (Objective.rows_without_gradient). The gradient is the same sum up to float
    # rounding (so not bit for bit: off by default, which keeps the committed tables reproducible);
    # actor/ metrics then average over the rows trained on. actor/rows_without_gradient_frac says
    # how much it saves.
    skip_rows_without_gradient: bool = False
    # Each distinct prompt of a micro-batch through the model once; the rows sharing it run only their
    # completions, attending to its keys and values on the autograd graph (Prefix Grouper's shared-prefix
    # forward, arXiv 2506.05433): a group of G costs P + G·T positions instead of G·(P + T). Same
    # logprobs and gradients up to float rounding (off by default, like skip_rows_without_gradient);
    # needs the KV cache, so not with gradient_checkpointing.
    shared_prompt_forward: bool = False
    # The policy's attention kernel (transformers' attn_implementation): null = the model's default
    # (sdpa); eager = plain matmul/softmax, which holds the [rows, heads, L, L] attention weights but is
    # faster for short rows (the tiny model: learner phase -18 % with shared_prompt_forward);
    # flash_attention_2 on GPUs that have it. Same math up to rounding.
    attn_implementation: Optional[str] = None
    # Token logprobs and entropy from the LM head in chunks of this many (row, position) slots, each
    # recomputed in backward, so full-vocabulary fp32 logits never exist for a whole micro-batch; null = off.
    logits_chunk_tokens: Optional[int] = None
    # Learning-rate schedule over RL steps (one per learner update): constant, cosine or linear decay to 0.
    lr_schedule: str = "constant"
    # Linear warm-up of the learning rate over this many RL steps (0 = none).
    warmup_steps: int = 0
    # Length of the schedule in RL steps; defaults to trainer.total_steps.
    total_steps: Optional[int] = "${trainer.total_steps}"  # type: ignore[assignment]
    # Memory of one learner device in GB (1e9 bytes); null = detect (CUDA total memory, or RAM on CPU).
    device_memory_gb: Optional[float] = None
    # Learner devices; > 1 means FSDP-style full sharding of weights, gradients and optimizer state.
    num_devices: int = 1
    # Memory plan before any weights load (grpo_lab/memory_plan.py): "check" refuses a config that does
    # not fit, "warn" only warns, "off" skips it.
    memory_plan: str = "check"
    # single = one process; fsdp2 = FSDP2 (fully_shard) over the ranks of a torchrun launch (make run-fsdp).
    strategy: str = "single"


@dataclass
class WarmupConfig:
    # Supervised warm-up on the task's worked solutions before RL (0 steps = skip).
    max_steps: int = 1500
    lr: float = 1e-3
    batch_size: int = 128
    # Stop once *sampled* (T=1) dev accuracy reaches this (greedy accuracy overstates readiness for RL).
    target_sampled_dev_accuracy: float = 0.30
    # Check the stopping rule every this many steps.
    eval_every: int = 50
    # Reuse a cached warmed-up checkpoint keyed by model, task, warm-up config and seed.
    cache: bool = True
    # Replay recorded warm-ups: seed -> the step at which a table's recorded run of that seed stopped. A listed
    # seed's warm-up trains exactly that many steps (no early stop; the checks still run and are logged), so a
    # row added on another machine, where fp32 rounding moves the early stop, starts from a warm-up as long as
    # its pairs'. A cached warm-up that stopped at that step is reused as it is. make_table --add-rows sets it
    # from the table's record. null = the stopping rule alone. Untyped for the reason
    # rollout.group_size_schedule is; validate() checks keys and values.
    replay_steps: Optional[Any] = None


@dataclass
class TrainerConfig:
    # RL steps (one rollout batch each); the run stops at whichever budget is reached first.
    total_steps: int = 150
    # Budget in generated completions (null = none): holds sampling cost fixed across group sizes.
    total_samples: Optional[int] = None
    # Prompts per step (each sampled group_size times).
    prompts_per_step: int = 32
    # Greedy held-out evaluation every this many steps (0 = only before and after).
    eval_every: int = 50
    # Held-out prompts used for evaluation ("test" split).
    eval_split: str = "test"
    # Also score k samples per held-out item at rollout.temperature and log their mean accuracy as
    # eval/sampled_accuracy (mean@k; DAPO reports avg@32): what the policy does when it samples, which
    # greedy accuracy hides when RL only sharpens the distribution. 0 = greedy only.
    eval_sampled_k: int = 0
    # Save the final policy under <run_dir>/checkpoints/final.
    save_checkpoint: bool = True
    # Write a resumable checkpoint (policy, optimizer, RNGs, prompt stream, counters...) every N steps; 0 = off.
    checkpoint_every: int = 0
    # Resumable checkpoints kept (the oldest beyond this are deleted).
    keep_checkpoints: int = 2
    # null = fresh run; "auto" = continue from the newest checkpoint of this run directory (if any);
    # or a checkpoint directory (<run dir>/checkpoints/step_N) to continue from.
    resume: Optional[str] = None
    # Every this many steps, the first trainer.samples_per_log training samples (prompt, completion, reward,
    # answer, reward functions' extras such as a judge's feedback) go to samples.jsonl and a wandb Table;
    # every evaluation logs its first samples_per_log completions too. 0 = training samples off.
    log_samples_every: int = 10
    samples_per_log: int = 8
    # How many updates the sampler may run ahead of the learner: 0 = synchronous (sample, learn, push;
    # the default and what the paper tables use); 1 = the engine samples step k+1 while the learner
    # trains on step k, from weights at most one update old (grpo_lab/sampling.py: RolloutPipeline).
    max_staleness: int = 0
    # Steps whose rewards, loss or gradient norm are not finite are skipped (no optimizer step, counted
    # as actor/skipped_steps); the run fails once more than this many were skipped.
    max_bad_steps: int = 3
    # Where the learner and the rollout engine run: "local" (this process), "engine_process" (the learner
    # here, the engine with vLLM's client in a child process: what trainer.max_staleness=1 wants;
    # grpo_lab/rollout/engine_process.py) or "ray" (Ray actors in a placement group; RAY_ADDRESS = an
    # existing cluster, else a local one; grpo_lab/ray_backend.py).
    backend: str = "local"
    # CPU cores when the rollout engine computes in processes of its own on the CPU (vLLM's CPU build):
    # "split" = the learner's threads on the first learner.num_threads cores, the engine's processes on
    # the rest (vLLM's readers spin while they wait, stealing a shared core's time slices from the
    # learner; grpo_lab/cpu_placement.py); "shared" = the OS spreads both over every core; "auto" =
    # split when trainer.max_staleness > 0 (both compute at once), shared in the synchronous loop.
    cpu_placement: str = "auto"


@dataclass
class LoggerConfig:
    # "wandb" or "none"; metrics.jsonl and summary.json are written either way.
    backend: str = "wandb"
    project: str = "grpo_lab"
    # wandb mode: "offline" unless the user configured wandb online (WANDB_MODE / `wandb login`); null = auto.
    mode: Optional[str] = None
    entity: Optional[str] = None
    # wandb group; multirun jobs default to the sweep's name.
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class CriticLLMConfig:
    """``interaction.critic``: the critic LLM's model, warm-up and training (grpo_lab/second_models/critic_llm.py)."""

    # The critic's model, as conf/model/*.yaml (conf/interaction/critic.yaml: a tiny_llama of the actor's size).
    model: ModelConfig = field(default_factory=ModelConfig)
    # SFT on synthetic (question, candidate) -> verifier feedback pairs before RL; max_steps=0: none.
    warmup: WarmupConfig = field(default_factory=lambda: WarmupConfig(
        max_steps=2000, lr=1e-3, batch_size=128, target_sampled_dev_accuracy=1.0, eval_every=250))
    # Perturbed candidates lie 1..max_offset from the reference (or have its sign flipped).
    max_offset: int = 10
    # Synthetic pairs per train item (a task with few items needs several), and held-out pairs (from
    # the task's dev split) the warm-up is scored on.
    warmup_pairs_per_item: int = 1
    warmup_dev_size: int = 200
    # false (frozen after the warm-up) | sft_top_bottom | rl.
    train: Any = False
    # One critic update every this many actor steps.
    update_every: int = 4
    # sft_top_bottom: fractions of a step's first answers taken as positives / negatives, and SFT steps per update.
    top_frac: float = 0.1
    bottom_frac: float = 0.1
    sft_steps: int = 4
    # rl: policy-gradient steps per update, the reward's verdict-agreement term, and the registered math.
    rl_steps: int = 1
    agreement_coef: float = 0.2
    advantage: str = "group_mean"
    policy_loss: str = "clipped_surrogate"
    clip_low: float = 0.2
    clip_high: float = 0.2
    loss_agg_mode: str = "token_mean"
    # Examples per optimizer step (sft_top_bottom and rl) and the critic's own AdamW learning rate.
    batch_size: int = 64
    lr: float = 1e-4
    # Global gradient-norm clip of the critic's steps, as learner.grad_clip is the policy's (0 = off).
    grad_clip: float = 1.0
    # auto (chat for a chat-template tokenizer, else solve_compact) | solve_compact | compact | chat
    # (grpo_lab/interaction/critic_feedback.py).
    feedback_format: str = "auto"
    # Sampling of the critic's feedback in training rollouts (evaluation is greedy) and its length cap.
    temperature: float = 1.0
    max_new_tokens: int = 8
    sampler: str = "generate"


@dataclass
class ToolConfig:
    # The tool of interaction=python_tool (grpo_lab/interaction/tool_env.py): a registered name of TOOLS
    # (python: the sandboxed interpreter) or a plug-in "package.module:factory".
    name: str = "python"
    # How the sandbox isolates a call (grpo_lab/interaction/sandbox.py): auto (namespaces as root, user
    # namespaces otherwise, where the machine allows; else rlimits with a warning) | namespaces | userns |
    # rlimits (resource limits and a Python audit hook only).
    isolation: str = "auto"
    # Per call: wall-clock seconds before the process group is killed, CPU seconds (RLIMIT_CPU), address
    # space in MB (RLIMIT_AS), processes (RLIMIT_NPROC), largest file in MB (RLIMIT_FSIZE), size of the
    # working directory's tmpfs in MB.
    wall_s: float = 5.0
    cpu_s: int = 2
    memory_mb: int = 256
    max_processes: int = 8
    file_size_mb: int = 1
    disk_mb: int = 8
    # The tool's reply to the actor: stdout, or the error's last line, cut to this many characters.
    max_output_chars: int = 200
    # Calls run at once (one process each); identical code within one reply batch runs once (dedupe).
    workers: int = 2
    dedupe: bool = True
    # How the actor writes a call, and the demonstrations are written: auto (tags <py>...</py> without a
    # chat template, the template's <tool_call> convention where it has one, else a ```python fence) |
    # tags | fence | tool_call. Every format is read whichever is set.
    call_format: str = "auto"
    # More paths hidden from the code (namespace modes), e.g. a dataset directory outside the repository.
    hide_paths: list[str] = field(default_factory=list)


@dataclass
class InteractionConfig:
    # Multi-turn rollouts (grpo_lab/interaction): after each actor answer an environment replies (feedback,
    # or done) and the actor revises. A registered environment (verifier_feedback) or a plug-in class
    # "package.module:Class"; null = single-turn (interaction=none, the default: nothing changes).
    environment: Optional[str] = None
    # Actor turns per conversation (1 = single-turn; >= 2 with an environment).
    max_turns: int = 1
    # Reward of a conversation from its actor turns' task rewards (grpo_lab/interaction/rewards.py):
    # final (last turn's), each_turn (mean over turns), improvement (last + α·(last − first), SCoRe).
    reward: str = "final"
    # α of reward=improvement.
    improvement_coef: float = 1.0
    # Share of the warm-up SFT's examples that are revision demonstrations: the prompt, a wrong answer, the
    # environment's message to it, then the worked solution. A model that never saw the multi-turn format
    # (the tiny character model) learns from them to read a message and answer again; a chat model needs
    # none (0, the default, adds nothing). The environment must say what it would answer
    # (its `demo_message`).
    warmup_revision_frac: float = 0.0
    # Environments whose messages the demonstrations are written in, taken in turn; null = the run's own.
    # Rows that compare environments (and a single-turn row, which has none) name one list, so that they
    # all start from one warm-up checkpoint and their differences pair by seed.
    warmup_demos_from: Optional[list[str]] = None
    # Share of the warm-up SFT's examples that are tool-use demonstrations (interaction=python_tool): the
    # prompt -> a call whose code computes the answer; then prompt + call + the tool's output -> the answer.
    # A model that never saw a call (the tiny character model) learns the format from them; 0 = none.
    warmup_tool_frac: float = 0.0
    # The tool of interaction=python_tool and its sandbox's limits; unused otherwise.
    tool: ToolConfig = field(default_factory=ToolConfig)
    # The critic LLM of interaction=critic (its model, warm-up, training and rhythm); unused otherwise.
    critic: CriticLLMConfig = field(default_factory=CriticLLMConfig)


@dataclass
class PreferenceDataConfig:
    """``reward_model.data``: the preferences a reward model learns from (grpo_lab/second_models/preference_data.py)."""

    # policy_samples: samples_per_prompt completions per prompt from the run's starting policy (the warm-up
    # checkpoint), labelled by the `gold` reward; jsonl: `path`, one {"prompt", "chosen", "rejected"[, "margin"]}
    # or {"prompt", "ranked": [best, ..., worst]} object a line.
    source: str = "policy_samples"
    path: Optional[str] = None
    # jsonl: a held-out file; null = the last held_out_frac of `path`'s lines.
    held_out_path: Optional[str] = None
    held_out_frac: float = 0.1
    # policy_samples: training pairs (from the task's train prompts) and held-out pairs (from its dev prompts).
    pairs: int = 2000
    held_out_pairs: int = 200
    samples_per_prompt: int = 4
    temperature: float = 1.0
    # The engine that samples them (grpo_lab.rollout): hf (transformers generate; no second engine start for a
    # tiny model) or vllm (a real model's thousands of samples).
    engine: str = "hf"
    # The gold scorer that labels samples: a registered reward (grpo_lab/rewards) or a plug-in import path.
    gold: str = "correctness_binary"
    # Probability that a training pair's labels are swapped: a noisy annotator (held-out pairs stay clean).
    label_noise: float = 0.0
    # pairs (Bradley-Terry) | ranked (one completion per distinct gold score, best first, for Plackett-Luce).
    form: str = "pairs"


@dataclass
class RewardModelConfig:
    """``reward_model``: a learned reward model's trunk, data and training (grpo_lab/second_models/)."""

    # The trunk under the scalar head: policy (the run's starting policy, the warm-up checkpoint, as InstructGPT
    # starts its reward model from the SFT model), base (the built model before any warm-up) or path (a local
    # Hugging Face directory; it may use another tokenizer than the policy's).
    trunk: str = "policy"
    path: Optional[str] = None
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    # A registered ranking loss (grpo_lab/algos/ranking.py): bradley_terry | plackett_luce.
    loss: str = "bradley_terry"
    # Llama 2's margin (arXiv 2307.09288 eq. 2): margin_scale x (gold of chosen - gold of rejected) for
    # sampled pairs; a jsonl pair's own "margin" field is used as written. 0 = no margin.
    margin_scale: float = 0.0
    lr: float = 1.0e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    # Groups (pairs) per optimizer step, at most this many steps, held-out evaluation every eval_every steps;
    # training stops after `patience` evaluations without a better held-out accuracy and keeps the best one.
    batch_size: int = 32
    # Groups per forward/backward within a step (null: the whole batch); the gradient is accumulated, so the
    # step is the same and only the memory of its activations changes.
    micro_batch_size: Optional[int] = None
    max_steps: int = 600
    eval_every: int = 25
    patience: int = 4
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    dtype: str = "fp32"
    # k reward models, each from its own seed (head initialisation and data order) on the same data: an ensemble.
    ensemble_size: int = 1
    # Online refresh during RL (iterative RLHF; Oat's online reward model): every refresh_every steps, up to
    # refresh_pairs pairs of that step's samples are labelled by data.gold (with data.label_noise) and every
    # member takes refresh_steps ranking steps on them. 0 = the reward model stays frozen.
    refresh_every: int = 0
    refresh_pairs: int = 64
    refresh_steps: int = 1
    # Reuse a cached reward model keyed by all of the above, the trunk and the data.
    cache: bool = True


@dataclass
class Config:
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    interaction: InteractionConfig = field(default_factory=InteractionConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    seed: int = 0
    # Derived at start (see derive_run_name) unless set.
    run_name: Optional[str] = None
    # Shared cache for built models and warmed-up checkpoints (relative to the launch directory).
    cache_dir: str = ".cache/grpo_lab"


def typed_sections(cfg) -> Config:
    """A run's resolved config as the schema's dataclasses: every section a typed object (attribute access
    only; no defaults left to restate), built once at the top of a run, each part of the run then handed
    its own section. Top-level keys outside the schema (a table's `variant` label) are left out."""
    from omegaconf import OmegaConf

    known = {f.name for f in dataclasses.fields(Config)}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config),
                                               {k: v for k, v in cfg.items() if k in known}))


def as_dict(section) -> dict:
    """A config section's values as a plain dict, whatever carries it: a typed section (a dataclass of
    this schema), an OmegaConf node (resolved) or a mapping."""
    if dataclasses.is_dataclass(section):
        return dataclasses.asdict(section)
    if hasattr(section, "_metadata"):   # an OmegaConf node, without importing OmegaConf here
        from omegaconf import OmegaConf

        return OmegaConf.to_container(section, resolve=True)
    return dict(section) if isinstance(section, Mapping) else dict(vars(section))
