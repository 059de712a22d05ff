"""The bad-input catalogue: every value that cannot work fails in `validate()`, which the
entry point runs before any model, tokenizer or engine loads, with a message that names the key to
change and says how. One row per case: (overrides, the key the message must name)."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from grpo_lab.config import finalize, register_configs, validate
from grpo_lab.schema import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()

# Words with which a message says what to do about the value (a range, the choices, the fix).
ADVICE = ("must", "valid choices", "set ", "raise", "give", "needs", "lower", "use ", "or null")

CATALOGUE = [
    (['rollout.group_size=0'], 'rollout.group_size'),
    (['rollout.group_size=1'], 'rollout.group_size'),
    (['algorithm.clip_low=1.5'], 'algorithm.clip_low'),
    (['algorithm.clip_high=0'], 'algorithm.clip_high'),
    (['algorithm.dual_clip=0.5'], 'algorithm.dual_clip'),
    (['algorithm.tis_cap=0.5'], 'algorithm.tis_cap'),
    (['algorithm.cispo_clip_high=0'], 'algorithm.cispo_clip_high'),
    (['algorithm.cispo_clip_low=-1'], 'algorithm.cispo_clip_low'),
    (['algorithm.gmpo_log_clip_high=0'], 'algorithm.gmpo_log_clip_high'),
    (['algorithm.sapo_tau_neg=0'], 'algorithm.sapo_tau_neg'),
    (['algorithm.dppo_delta_high=1.5'], 'algorithm.dppo_delta_high'),
    (['algorithm.dppo_ratio_cap=0.5'], 'algorithm.dppo_ratio_cap'),
    (['algorithm.rollout_correction.level=tokens'], 'algorithm.rollout_correction.level'),
    (['algorithm.rollout_correction.level=token', 'algorithm.rollout_correction.mode=clip'],
     'algorithm.rollout_correction.mode'),
    (['algorithm.rollout_correction.level=token', 'algorithm.rollout_correction.upper=0.5'],
     'algorithm.rollout_correction.upper'),
    (['algorithm.rollout_correction.level=sequence', 'algorithm.rollout_correction.lower=2'],
     'algorithm.rollout_correction.lower'),
    (['algorithm=dpo', 'algorithm.rollout_correction.level=token'], 'algorithm.rollout_correction.level'),
    (['algorithm.kl.coef=-1'], 'algorithm.kl.coef'),
    (['algorithm.kl.placement=middle'], 'algorithm.kl.placement'),
    (['algorithm.kl.estimator=k4'], 'algorithm.kl.estimator'),
    (['algorithm.advantage=zscore'], 'algorithm.advantage'),
    (['algorithm.policy_loss=ppo'], 'algorithm.policy_loss'),
    (['algorithm.aggregation=mean'], 'algorithm.aggregation'),
    (['algorithm.advantage=gae'], 'algorithm.advantage'),
    (['algorithm.epochs=0'], 'algorithm.epochs'),
    (['algorithm.minibatches=10000'], 'algorithm.minibatches'),
    (['algorithm.entropy_coef=-0.1'], 'algorithm.entropy_coef'),
    (['algorithm.reward_ema_decay=1.5'], 'algorithm.reward_ema_decay'),
    (['algorithm.overlong.soft_buffer=-1'], 'algorithm.overlong.soft_buffer'),
    (['algorithm.overlong.soft_buffer=100'], 'algorithm.overlong.soft_buffer'),
    (['algorithm.dynamic_sampling.max_rounds=0'], 'algorithm.dynamic_sampling.max_rounds'),
    (['algorithm.objective=sft'], 'algorithm.objective'),
    (['algorithm=dpo', 'algorithm.preference.loss=kto'], 'algorithm.preference.loss'),
    (['algorithm=dpo', 'algorithm.preference.pairing=random'], 'algorithm.preference.pairing'),
    (['algorithm=dpo', 'algorithm.preference.beta=0'], 'algorithm.preference.beta'),
    (['algorithm=dpo', 'algorithm.preference.pairs=/nonexistent/pairs.jsonl'], 'algorithm.preference.pairs'),
    (['algorithm=dpo', 'rollout.group_size=1'], 'rollout.group_size'),
    (['algorithm.gamma=1.5'], 'algorithm.gamma'),
    (['reward.noise.kind=bogus'], 'reward.noise.kind'),
    (['reward.noise.kind=flip', 'reward.noise.flip_prob=1.5'], 'reward.noise.flip_prob'),
    (['reward=scorer', 'reward.noise.kind=flip'], 'reward.noise.kind'),
    (['reward.noise.kind=gaussian', 'reward.noise.std=-1'], 'reward.noise.std'),
    (['algorithm=dpo', 'algorithm.preference.label_flip_prob=2'], 'algorithm.preference.label_flip_prob'),
    (['algorithm=dpo', 'algorithm.preference.label_smoothing=0.5'], 'algorithm.preference.label_smoothing'),
    (['algorithm.critic.lr=0'], 'algorithm.critic.lr'),
    (['learner.lr=0'], 'learner.lr'),
    (['learner.lr=nan'], 'learner.lr'),
    (['learner.lr=inf'], 'learner.lr'),
    (['reward.weights.correctness_binary=nan'], 'reward.weights.correctness_binary'),
    (['learner.micro_batch_size=0'], 'learner.micro_batch_size'),
    (['learner.device=tpu'], 'learner.device'),
    (['learner.num_threads=0'], 'learner.num_threads'),
    (['learner.grad_clip=-1'], 'learner.grad_clip'),
    (['learner.weight_decay=-0.1'], 'learner.weight_decay'),
    (['rollout.temperature=0'], 'rollout.temperature'),
    (['rollout.top_p=0'], 'rollout.top_p'),
    (['rollout=hf', 'rollout.sampler=beam'], 'rollout.sampler'),
    (['rollout=vllm', 'rollout.sampler=beam'], 'rollout.sampler'),
    (['learner.attn_implementation=flash'], 'learner.attn_implementation'),
    (['trainer.cpu_placement=numa'], 'trainer.cpu_placement'),
    (['rollout.gpu_memory_utilization=0'], 'rollout.gpu_memory_utilization'),
    (['rollout.max_new_tokens=0'], 'rollout.max_new_tokens'),
    (['rollout.max_new_tokens=300'], 'rollout.max_new_tokens'),
    (['rollout.engine=sglang'], 'rollout.engine'),
    (['rollout.group_size_schedule={0:4}'], 'rollout.group_size_schedule'),
    (['trainer.prompts_per_step=0'], 'trainer.prompts_per_step'),
    (['trainer.total_steps=-1'], 'trainer.total_steps'),
    (['trainer.total_samples=10'], 'trainer.total_samples'),
    (['trainer.eval_split=train'], 'trainer.eval_split'),
    (['trainer.eval_every=-1'], 'trainer.eval_every'),
    (['trainer.checkpoint_every=-1'], 'trainer.checkpoint_every'),
    (['trainer.keep_checkpoints=0'], 'trainer.keep_checkpoints'),
    (['trainer.max_bad_steps=-1'], 'trainer.max_bad_steps'),
    (['trainer.resume=/nonexistent/ckpt'], 'trainer.resume'),
    (['task.test_size=0'], 'task.test_size'),
    (['task.dev_size=0'], 'task.dev_size'),
    (['task.train_size=0'], 'task.train_size'),
    (['task.name=no_such_generator'], 'task.name'),
    (['task.source=nope'], 'task.source'),
    (['task.prompt_format=essay'], 'task.prompt_format'),
    (['model=pretrained'], 'model.path'),
    (['model.builder=gpt5'], 'model.builder'),
    (['logger.backend=tensorboard'], 'logger.backend'),
    (['warmup.target_sampled_dev_accuracy=2'], 'warmup.target_sampled_dev_accuracy'),
    (['warmup.max_steps=-5'], 'warmup.max_steps'),
    (['+reward.weights.nope=1'], 'reward.weights.nope'),
    (['reward.timeout_s=0'], 'reward.timeout_s'),
    (['reward.max_error_frac=2'], 'reward.max_error_frac'),
    (['task.source=local_dataset'], 'task.source'),
    (['rollout.generate_timeout_s=-1'], 'rollout.generate_timeout_s'),
    (['rollout.tensor_parallel_size=0'], 'rollout.tensor_parallel_size'),
    (['rollout=hf', 'rollout.data_parallel_size=2'], 'rollout.data_parallel_size'),
    (['rollout.tensor_parallel_size=64', 'rollout.data_parallel_size=2'], 'rollout.tensor_parallel_size'),
    (['reward=llm_judge', 'reward.judge.builder=pretrained', 'reward.judge.path=/nonexistent'], 'reward.judge.path'),
    (['interaction=critic_qwen2_5_1_5b', 'interaction.critic.model.path=/nonexistent'], 'interaction.critic.model.path'),
    (['rollout.group_size_schedule=1:4'], 'rollout.group_size_schedule'),
    (['rollout=hf', 'rollout.dtype=fp7'], 'rollout.dtype'),
    (['rollout=vllm', 'rollout.dtype=fp7'], 'rollout.dtype'),
    (['rollout.gpu_memory_utilization=1.0'], 'rollout.gpu_memory_utilization'),
    (['task.source=local_dataset', 'task.path=/data/a.jsonl', 'task.splits=train'], 'task.splits'),
    # The run directory's name (a run directory given with hydra.run.dir does not go through the resolver).
    (['run_name=x/../../escaped'], 'run_name'),
    (['run_name=a\\\\b'], 'run_name'),
    (['run_name=.hidden'], 'run_name'),
    (["run_name=''"], 'run_name'),
]


def compose_cfg(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=list(overrides)))


def test_the_catalogue_is_large_enough():
    assert len(CATALOGUE) >= 40


@pytest.mark.parametrize("overrides,key", CATALOGUE, ids=[" ".join(o) for o, _ in CATALOGUE])
def test_bad_value_fails_before_anything_loads_naming_the_key(overrides, key):
    cfg = compose_cfg(overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    problems = str(err.value).split("\n  - ")[1:]
    named = [p for p in problems if key in p]
    assert named, f"no message names {key}: {problems}"
    assert any(word in p for p in named for word in ADVICE), f"no message says what to change: {named}"


def test_the_default_config_is_valid():
    validate(compose_cfg([]))


def test_the_retired_tis_cap_is_refused_with_its_replacement():
    """algorithm.tis_cap=C (before algorithm.rollout_correction) is refused with the exact spelling that does the
    same, and that spelling validates."""
    (problem,) = [p for p in _problems(["algorithm.tis_cap=2"]) if "tis_cap" in p]
    replacement = ("algorithm.rollout_correction.level=token algorithm.rollout_correction.mode=truncate "
                   "algorithm.rollout_correction.upper=2.0")
    assert replacement in problem and "remove algorithm.tis_cap" in problem
    validate(compose_cfg(replacement.split()))


def test_a_group_switch_does_not_carry_over_generator_kwargs():
    """task.name=gcd keeps chain_sum's dataset_kwargs (Hydra merges dicts): a clear error says to switch
    with task=<file> instead; task=gcd itself is valid."""
    with pytest.raises(ConfigError, match="task.dataset_kwargs"):
        validate(compose_cfg(["task.name=gcd", "task.prompt_format=question"]))
    validate(compose_cfg(["task=gcd"]))


def test_a_real_model_recipe_switches_task_with_one_override():
    """The recipe pins no generator kwargs, so task=<file> replaces its task whole, as for the tiny model."""
    cfg = compose_cfg(["experiment=smollm2_chain_sum", "task=gcd"])
    validate(cfg)
    assert cfg.task.name == "gcd" and cfg.model.builder == "smollm2_135m" and cfg.task.prompt_format == "question"
    assert dict(cfg.task.dataset_kwargs) == dict(compose_cfg(["task=gcd"]).task.dataset_kwargs)


def test_a_missing_judge_path_is_left_to_the_machine_that_runs():
    """reward.judge.path names a directory of the machine that runs: validate(machine=False) does not ask."""
    validate(compose_cfg(["reward=llm_judge", "reward.judge.builder=pretrained", "reward.judge.path=/nonexistent",
                          "learner.memory_plan=off"]), machine=False)


def test_a_critic_model_directory_that_is_not_here_is_refused_naming_the_setting_and_the_path(tmp_path):
    """interaction.critic.model.path must be a model directory on the machine that runs: the critic is built
    after the actor's warm-up and engine, so a wrong path failed minutes in. validate(machine=False) (a
    recipe checked for another machine, gpu_critique's /models path) does not ask."""
    critic = ["interaction=critic_qwen2_5_1_5b"]
    missing = tmp_path / "no_such_critic"
    (problem,) = [p for p in _problems([*critic, f"interaction.critic.model.path={missing}"])
                  if "interaction.critic.model.path" in p]
    assert problem.startswith(f"interaction.critic.model.path='{missing}' is not a directory on this machine: give a "
                              "local HF model directory"), problem
    validate(compose_cfg([*critic, f"interaction.critic.model.path={missing}"]), machine=False)

    empty = tmp_path / "empty"
    empty.mkdir()
    (problem,) = [p for p in _problems([*critic, f"interaction.critic.model.path={empty}"])
                  if "interaction.critic.model.path" in p]
    assert f"interaction.critic.model.path='{empty}' is not a complete HF model directory" in problem
    assert "(found: nothing)" in problem

    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (model / name).write_text("{}")
    cfg = compose_cfg([*critic, f"interaction.critic.model.path={model}"])
    try:
        validate(cfg)
    except ConfigError as err:     # whatever else this machine says: not the critic's directory
        assert "interaction.critic.model.path" not in str(err), str(err)


def _problems(overrides) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(overrides))
    return str(err.value).split("\n  - ")[1:]


def test_a_group_size_no_estimator_fits_says_to_raise_it():
    """G=0: no advantage estimator learns from it, so the message names none to switch to; G=1 names the
    batch-level one."""
    (zero,) = [p for p in _problems(["rollout.group_size=0"]) if "nothing is learned" in p]
    assert "set  " not in zero and "or set" not in zero, zero
    assert "raise rollout.group_size to >= 2 (no algorithm.advantage learns from groups of 0 samples)" in zero
    (one,) = [p for p in _problems(["rollout.group_size=1"]) if "nothing is learned" in p]
    assert "or set algorithm.advantage=reinforce_pp (batch-level baseline)" in one


def test_overlapping_split_seeds_cite_the_configs_defaults():
    """The seed-overlap message's defaults are the schema's, and following them passes validation."""
    import re

    from grpo_lab.schema import TaskConfig

    (problem,) = [p for p in _problems(["task.dev_seed=1000005"]) if p.startswith("task.*_seed")]
    cited = dict(re.findall(r"(task\.\w+_seed)=(\d+)", problem))
    assert cited == {f"task.{s}_seed": str(getattr(TaskConfig, f"{s}_seed")) for s in ("train", "dev", "test")}, problem
    validate(compose_cfg([f"{k}={v}" for k, v in cited.items()]))


def test_cdpo_is_refused_naming_dpo_with_label_smoothing():
    (problem,) = _problems(["algorithm=dpo", "algorithm.preference.loss=cdpo"])
    assert problem.startswith("algorithm.preference.loss='cdpo' is not registered")
    assert "algorithm.preference.loss=dpo algorithm.preference.label_smoothing=<ε>" in problem
    validate(compose_cfg(["algorithm=dpo", "algorithm.preference.loss=dpo", "algorithm.preference.label_smoothing=0.1"]))
