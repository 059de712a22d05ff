"""Multi-turn rollouts (grpo_lab/interaction): the verifier's feedback texts, the turn rewards, the token
layout between turns (character model and a chat template), the multi-turn rollout's structure, the
learner never training on environment tokens, validation, and runs on the tiny model (2 steps; a
plug-in environment's run killed and resumed equals an uninterrupted one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from helpers import REPO, TINY_RUN, read_metrics, run_train, train_in_process
from grpo_lab.config import finalize, register_configs, validate
from grpo_lab.interaction import ENVIRONMENTS, message_alphabet, multi_turn_rollout, reference_problem
from grpo_lab.interaction.rewards import conversation_metrics, each_turn, final, improvement, padded_turns, turn_metrics
from grpo_lab.interaction.rollout import TURN_SEED_STRIDE
from grpo_lab.interaction.verifier import verifier_message
from grpo_lab.models import MODEL_BUILDERS, build_char_tokenizer
from grpo_lab.prompts import configure_tokenizer, encode_prompt, environment_turn_ids
from grpo_lab.rollout import Rollout
from grpo_lab.run_setup import check_context
from grpo_lab.schema import AlgorithmConfig, Config, ConfigError, InteractionConfig, LearnerConfig
from grpo_lab.tasks import Task, TaskItem


def interaction(**values):
    """A whole typed interaction section: the schema's defaults under `values`."""
    return OmegaConf.merge(OmegaConf.structured(InteractionConfig), values)


def with_interaction(**values):
    """A whole run config (the schema's defaults) whose interaction section has `values`."""
    return OmegaConf.merge(OmegaConf.structured(Config), {"interaction": values})


CHARS = "0123456789-=" + message_alphabet(interaction(environment="verifier_feedback"))


def item(answer: str, fmt: str = "plain", prompt: str = "15-43=") -> TaskItem:
    return TaskItem(prompt=prompt, answer=answer, solution=answer, fields={"answer_format": fmt})


# ------------------------------------------------------------------ verifier_feedback


@pytest.mark.parametrize("text,message", [("-28", "correct"), ("-30", "wrong: too low"), ("5", "wrong: too high"),
                                          ("28", "wrong: off by a sign"), ("", "wrong: no answer found"),
                                          ("abc", "wrong")])
def test_verifier_feedback_texts(text, message):
    assert verifier_message(text, item("-28")) == message


def test_verifier_reads_the_items_answer_format_and_non_numeric_references():
    assert verifier_message("worked it out", item("-28", "hash")) == "wrong: no answer found"
    assert verifier_message("so\n#### 30", item("-28", "hash")) == "wrong: too high"
    assert verifier_message("dog", item("cat")) == "wrong"
    assert verifier_message("0", item("0")) == "correct" and verifier_message("1", item("0")) == "wrong: too high"


def test_verifier_replies_done_exactly_when_correct():
    env = ENVIRONMENTS.get("verifier_feedback")(None, tokenizer=None, task=None)
    right, wrong = env.reply([item("-28"), item("-28")], [["-28"], ["-30"]], seed=0, greedy=True)
    assert (right.done, right.verdict, right.message) == (True, True, None)
    assert (wrong.done, wrong.verdict, wrong.message) == (False, False, "wrong: too low")
    assert ENVIRONMENTS.fact("verifier_feedback", "learns") is False


# ------------------------------------------------------------------ turn rewards (pure)


def test_turn_reward_options_by_hand():
    rewards, n_turns = padded_turns([[0.0, 1.0], [1.0, 0.0], [1.0], [0.0, 0.0]])
    assert rewards.tolist() == [[0, 1], [1, 0], [1, 0], [0, 0]] and n_turns.tolist() == [2, 2, 1, 2]
    assert final(rewards, n_turns).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert each_turn(rewards, n_turns).tolist() == [0.5, 0.5, 1.0, 0.0]
    # r_K + α (r_K − r_1), α = 0.5: wrong → right 1.5, right → wrong −0.5, one turn r_1, wrong → wrong 0
    assert improvement(rewards, n_turns, improvement_coef=0.5).tolist() == [1.5, -0.5, 1.0, 0.0]


def test_reward_phase_scores_every_actor_turn():
    from grpo_lab.sampling import reward_phase

    rollout = Rollout([[1], [1]], [[4], [4]], [[0.0], [0.0]], ["-28", "-30"], [0, 0], [False, False],
                      loss_masks=[[1], [1]], turns=[["-30", "wrong: too low", "-28"], ["-28", "wrong", "-30"]],
                      verdicts=[[False], [True]], env_info=[[{}], [{}]])
    cfg = make(["interaction=verifier_feedback", "interaction.reward=improvement", "reward=correctness"])
    scored, metrics = reward_phase(rollout, [item("-28")], cfg.reward, cfg.algorithm, max_new_tokens=8, seed=0,
                                   interaction_cfg=cfg.interaction)
    assert scored.rewards.tolist() == [2.0, -1.0] and scored.correct.tolist() == [1.0, 0.0]
    assert scored.info["turn_rewards"] == [[0.0, 1.0], [1.0, 0.0]]
    assert metrics["reward/correctness_binary"] == 0.5          # the last answers'
    assert conversation_metrics(scored.info["turn_correct"]) == {
        "interaction/first_acc": 0.5, "interaction/final_acc": 0.5, "interaction/wrong_to_right": 0.5,
        "interaction/right_to_wrong": 0.5, "interaction/revision_gain": 0.0, "interaction/turns_mean": 2.0}
    gained = conversation_metrics([[False, True], [False, True], [True, True], [False, False]])
    assert gained["interaction/revision_gain"] == 0.5 == gained["interaction/wrong_to_right"]
    assert scored.sample_rows(1)[0]["turns"] == ["-30", "wrong: too low", "-28"]


# ------------------------------------------------------------------ the tokens between turns


def test_char_tokenizer_format_after_eos():
    tok = build_char_tokenizer(CHARS)
    message = tok.encode("?wrong: too low\n", add_special_tokens=False)
    answer = tok.encode("-30", add_special_tokens=False)
    assert environment_turn_ids(tok, "wrong: too low", answer_ids=answer + [tok.eos_token_id]) == message
    assert environment_turn_ids(tok, "wrong: too low", answer_ids=answer) == [tok.eos_token_id, *message]
    assert tok.unk_token_id not in message
    assert message_alphabet(interaction(environment=None)) == ""      # single-turn: the tiny model's alphabet unchanged


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def chat_tokenizer():
    """A tokenizer with a ChatML chat template (SmolLM2-Instruct's), built offline from characters."""
    tok = build_char_tokenizer(CHARS + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML
    return tok


def _template_ids(tok, messages):
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_chat_template_format_is_what_the_template_renders(system):
    tok = configure_tokenizer(chat_tokenizer(), system_prompt=system)
    prompt, answer = encode_prompt(tok, "15-43="), tok.encode("-30", add_special_tokens=False)
    reference = _template_ids(tok, [*([{"role": "system", "content": system}] if system else []),
                                    {"role": "user", "content": "15-43="}, {"role": "assistant", "content": "-30"},
                                    {"role": "user", "content": "wrong: too low"}])
    eos = tok.eos_token_id
    ended = environment_turn_ids(tok, "wrong: too low", answer_ids=answer + [eos])
    assert prompt + answer + [eos] + ended == reference                  # the sampled EOS is not written twice
    cut = environment_turn_ids(tok, "wrong: too low", answer_ids=answer)   # cut at max_new_tokens: closed here
    assert prompt + answer + cut == reference


# ------------------------------------------------------------------ the multi-turn rollout


class ScriptedEngine:
    """An engine whose call c answers row k with script[c][k] + <eos>; records each call."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, prompt_ids, *, n, temperature, top_p, max_new_tokens, seed, logprobs=True):
        texts = self.script[len(self.calls)]
        self.calls.append({"prompts": [list(p) for p in prompt_ids], "n": n, "seed": seed})
        out = Rollout([], [], [], [], [], [])
        for k in range(len(prompt_ids) * n):
            ids = self.tok.encode(texts[k], add_special_tokens=False) + [self.tok.eos_token_id]
            out.prompt_ids.append(list(prompt_ids[k // n]))
            out.completion_ids.append(ids)
            out.sampler_logprobs.append([-0.5] * len(ids) if logprobs else [])
            out.texts.append(texts[k])
            out.group_ids.append(k // n)
            out.truncated.append(False)
        return out


def test_multi_turn_rollout_layout():
    tok = build_char_tokenizer(CHARS)
    env = ENVIRONMENTS.get("verifier_feedback")(None, tokenizer=tok, task=None)
    engine = ScriptedEngine(tok, [["-30", "-28"], ["-28"]])
    sampling = OmegaConf.create({"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "max_model_len": 256})
    out = multi_turn_rollout(engine, tok, [item("-28")], env, group_size=2, max_turns=3, rollout_cfg=sampling, seed=5)
    prompt = encode_prompt(tok, "15-43=")
    first = tok.encode("-30", add_special_tokens=False) + [tok.eos_token_id]
    message = tok.encode("?wrong: too low\n", add_special_tokens=False)
    second = tok.encode("-28", add_special_tokens=False) + [tok.eos_token_id]
    assert len(engine.calls) == 2                  # turn 3 never runs: both conversations ended "correct"
    assert engine.calls[1] == {"prompts": [prompt + first + message], "n": 1, "seed": 5 + 2 * TURN_SEED_STRIDE}
    assert out.prompt_ids == [prompt, prompt] and out.group_ids == [0, 0]
    assert out.completion_ids == [first + message + second, second]
    assert out.loss_masks == [[1] * len(first) + [0] * len(message) + [1] * len(second), [1] * len(second)]
    assert out.sampler_logprobs[0] == [-0.5] * len(first) + [0.0] * len(message) + [-0.5] * len(second)
    assert out.turns == [["-30", "wrong: too low", "-28"], ["-28"]] and out.texts == ["-28", "-28"]
    assert out.verdicts == [[False, True], [True]]
    picked = Rollout.concat([out.select([1]), out.select([0])])
    assert picked.turns == [out.turns[1], out.turns[0]] and picked.loss_masks == [out.loss_masks[1], out.loss_masks[0]]


@pytest.mark.parametrize("spare", [0, -1])
def test_a_conversation_that_would_overflow_the_context_ends_where_it_is(spare):
    """The next turn needs prompt + history + message + max_new_tokens <= rollout.max_model_len; with one
    token too few the conversation ends after its first answer (the engine is not asked, the step's
    interaction/context_full counts it), with exactly enough it goes on."""
    tok = build_char_tokenizer(CHARS)
    env = ENVIRONMENTS.get("verifier_feedback")(None, tokenizer=tok, task=None)
    prompt = encode_prompt(tok, "15-43=")
    first = tok.encode("-30", add_special_tokens=False) + [tok.eos_token_id]
    message = tok.encode("?wrong: too low\n", add_special_tokens=False)
    need = len(prompt) + len(first) + len(message) + 8
    engine = ScriptedEngine(tok, [["-30", "-28"], ["-28"]])
    sampling = OmegaConf.create({"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "max_model_len": need + spare})
    out = multi_turn_rollout(engine, tok, [item("-28")], env, group_size=2, max_turns=2, rollout_cfg=sampling, seed=0)
    full = spare < 0
    assert len(engine.calls) == (1 if full else 2)
    assert out.turns[0] == (["-30"] if full else ["-30", "wrong: too low", "-28"])
    assert bool(out.env_info[0][0].get("context_full")) is full and not out.env_info[1][0].get("context_full")
    scored = SimpleNamespace(rollout=out, info={"turn_correct": [[False] if full else [False, True], [True]]})
    assert turn_metrics(scored)["interaction/context_full"] == (0.5 if full else 0.0)


def test_the_context_check_makes_room_for_every_actor_turn():
    """A prompt that fits one answer but not interaction.max_turns of them is refused before any work, and
    the error names the setting to change."""
    cfg = make(["interaction=verifier_feedback", "rollout.max_new_tokens=8"])
    tok = build_char_tokenizer(CHARS)
    task = SimpleNamespace(splits={"train": [item("-28")]})
    cfg.rollout.max_model_len = len(encode_prompt(tok, "15-43=")) + 2 * 8
    check_context(cfg, task, tok)                                            # two answers fit exactly
    cfg.rollout.max_model_len -= 1
    with pytest.raises(ConfigError, match="interaction.max_turns=2") as err:
        check_context(cfg, task, tok)
    assert f"rollout.max_model_len to >= {cfg.rollout.max_model_len + 1}" in str(err.value)
    single = make(["rollout.max_new_tokens=8", f"rollout.max_model_len={cfg.rollout.max_model_len}"])
    check_context(single, task, tok)                                         # single-turn: one answer's room


def test_a_plug_in_environment_by_import_path():
    tok = build_char_tokenizer(CHARS)
    env = ENVIRONMENTS.get("interaction_plugins:Hint")(None, tokenizer=tok, task=None)
    engine = ScriptedEngine(tok, [["-30", "-28"], ["-29", "-27"]])
    sampling = OmegaConf.create({"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "max_model_len": 256})
    out = multi_turn_rollout(engine, tok, [item("-28")], env, group_size=2, max_turns=2, rollout_cfg=sampling, seed=0)
    assert out.turns == [["-30", "hint: retry", "-29"], ["-28", "hint: retry", "-27"]]
    assert out.verdicts == [[None], [None]] and out.env_info == [[{"seen": 1}], [{"seen": 1}]]
    assert message_alphabet(interaction(environment="interaction_plugins:Hint")) == message_alphabet(
        interaction(environment="verifier_feedback"))
    validate(make(["interaction.environment=interaction_plugins:Hint", "interaction.max_turns=2"]))


# ------------------------------------------------------------------ the learner never trains on environment tokens


def test_environment_tokens_are_masked_and_actor_logprobs_match_a_fresh_forward(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_lab.learner.learner import Learner
    from grpo_lab.objectives import OBJECTIVES
    from grpo_lab.sampling import RewardNormalizer, ScoredRollout, to_learner_batch

    model_dir = MODEL_BUILDERS.get("tiny_llama")(tmp_path / "model", alphabet=CHARS, seed=0)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    env = ENVIRONMENTS.get("verifier_feedback")(None, tokenizer=tok, task=None)
    engine = ScriptedEngine(tok, [["-30", "-28"], ["-28"]])
    sampling = OmegaConf.create({"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "max_model_len": 256})
    rollout = multi_turn_rollout(engine, tok, [item("-28")], env, group_size=2, max_turns=2, rollout_cfg=sampling,
                                 seed=0)
    scored = ScoredRollout(rollout, [item("-28")] * 2, torch.tensor([1.0, 0.5]), torch.tensor([1.0, 1.0]))
    batch = to_learner_batch(scored, tok)
    masks = [torch.tensor(m, dtype=torch.float32) for m in rollout.loss_masks]
    T = batch["response_mask"].shape[1]
    assert torch.equal(batch["response_mask"], torch.stack([torch.nn.functional.pad(m, (0, T - len(m))) for m in masks]))
    assert (batch["response_mask"][0] == 0).sum() == 16           # "?wrong: too low\n" is the environment's
    assert batch.lengths()[1].tolist() == [len(c) for c in rollout.completion_ids]   # env tokens are real tokens

    algo = OmegaConf.merge(OmegaConf.structured(AlgorithmConfig), {"advantage": "reinforce_pp", "gamma": 0.5})
    learner_cfg = OmegaConf.merge(OmegaConf.structured(LearnerConfig), {"device": "cpu", "grad_clip": 0.0})
    learner = Learner(model_dir, objective=OBJECTIVES.get("policy_gradient"), learner_cfg=learner_cfg, algo_cfg=algo,
                      temperature=1.0, seed=0, max_completion_len=8)
    with torch.no_grad():
        logprobs = learner.policy_logprobs(batch)[0]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    for k, (p, c) in enumerate(zip(rollout.prompt_ids, rollout.completion_ids)):
        with torch.no_grad():
            logits = model(torch.tensor([p + c])).logits[0].float()
        fresh = torch.log_softmax(logits[len(p) - 1:-1], -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
        actor = masks[k].bool()
        assert torch.allclose(logprobs[k, :len(c)][actor], fresh[actor], atol=1e-5)

    prepared, _ = OBJECTIVES.get("policy_gradient").prepare(batch, algo, normalizer=RewardNormalizer(None), step=1)
    last = len(rollout.completion_ids[0]) - 1          # the revision's <eos>: the last actor token
    assert prepared["returns"][0, last] == 1.0 and prepared["returns"][1, len(rollout.completion_ids[1]) - 1] == 0.5
    assert torch.equal(prepared["loss_mask"][0, :len(masks[0])], masks[0])


# ------------------------------------------------------------------ validation


CONF = REPO / "conf"


def make(overrides=()):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=list(overrides)))


@pytest.mark.parametrize("overrides,key", [
    (["interaction=verifier_feedback", "interaction.max_turns=1"], "interaction.max_turns=1"),
    (["interaction.max_turns=3"], "interaction.max_turns=3"),
    (["interaction=verifier_feedback", "interaction.reward=best"], "interaction.reward"),
    (["interaction.environment=nope"], "interaction.environment"),
    (["interaction=verifier_feedback", "algorithm=dpo"], "algorithm.objective"),
    (["interaction=verifier_feedback", "interaction.warmup_revision_frac=1.0"], "interaction.warmup_revision_frac=1.0"),
    (["interaction=verifier_feedback", "interaction.warmup_revision_frac=0.5", "warmup.max_steps=0"],
     "warmup.max_steps=0"),
    (["interaction.environment=interaction_plugins.Hint", "interaction.max_turns=2",
      "interaction.warmup_revision_frac=0.5"], "no demo_message"),
])
def test_bad_interaction_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(make(overrides), machine=False)


def test_the_default_is_single_turn_and_verifier_feedback_validates():
    cfg = make()
    assert cfg.interaction.environment is None and cfg.interaction.max_turns == 1
    validate(make(["interaction=verifier_feedback"]), machine=False)


def test_an_environment_that_compares_answers_needs_references():
    task = Task("t", {"train": [item("-28"), item(" ")], "dev": [item("1")], "test": [item("2")]})
    problem = reference_problem(interaction(environment="verifier_feedback"), task)
    assert "interaction.environment=verifier_feedback" in problem and "1 items" in problem
    assert reference_problem(interaction(environment=None), task) is None


# ------------------------------------------------------------------ runs on the tiny model


@pytest.fixture(scope="module")
def multi_turn_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("multi_turn_cache")


def test_two_steps_of_verifier_feedback_train_only_on_actor_tokens(tmp_path, monkeypatch):
    import grpo_lab.train as train

    seen = []

    def recording(scored, tokenizer, _real=train.to_learner_batch):
        batch = _real(scored, tokenizer)
        seen.append((scored.rollout.loss_masks, batch["response_mask"].clone()))
        return batch

    monkeypatch.setattr(train, "to_learner_batch", recording)
    run_dir = tmp_path / "run"
    # Its own brief warm-up (revision demonstrations key it apart from the shared one): 100 steps leave wrong
    # first answers, so second turns, and their environment tokens, occur.
    code = train_in_process([*TINY_RUN, "rollout=hf", "interaction=verifier_feedback", "trainer.log_samples_every=1",
                             "warmup.max_steps=100", f"hydra.run.dir={run_dir}", f"cache_dir={tmp_path / 'cache'}"],
                            monkeypatch)
    assert code == 0, (run_dir / "summary.json").read_text() if (run_dir / "summary.json").exists() else code
    lines = read_metrics(run_dir)
    for m in lines[1:3]:
        for key in ("first_acc", "final_acc", "wrong_to_right", "right_to_wrong", "turns_mean", "env_tokens_mean"):
            assert f"interaction/{key}" in m
        assert 1.0 <= m["interaction/turns_mean"] <= 2.0
    assert {"eval/first_acc", "eval/wrong_to_right", "eval/right_to_wrong", "eval/revision_gain"} <= set(lines[0]) & set(lines[-1])
    assert len(seen) == 2
    env_tokens = 0
    for masks, response_mask in seen:
        for k, m in enumerate(masks):
            assert response_mask[k, :len(m)].tolist() == [float(x) for x in m]
            env_tokens += m.count(0)
    assert env_tokens > 0   # a 100-step warm-up answers wrong often enough for second turns
    rows = [json.loads(s) for s in (run_dir / "samples.jsonl").read_text().splitlines() if s.strip()]
    assert rows and all("turns" in r for r in rows)


@pytest.mark.slow
def test_kill_9_then_resume_with_a_plug_in_environment_equals_an_uninterrupted_run(tmp_path, multi_turn_cache,
                                                                                    monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(REPO / "tests")]))
    run = [*TINY_RUN, "rollout=hf", "interaction.environment=interaction_plugins:Hint", "interaction.max_turns=2",
           "interaction.reward=improvement"]
    reference = killed_and_resumed_equals_uninterrupted(run, tmp_path, multi_turn_cache)
    assert [m["hint/steps"] for m in reference[1:5]] == [1.0, 2.0, 3.0, 4.0]   # the environment's state came back


def killed_and_resumed_equals_uninterrupted(run: list[str], tmp_path: Path, cache: Path) -> list[dict]:
    """`run` for 4 steps (checkpoints every 2) uninterrupted, and again killed with -9 after step 3 and
    resumed (step 3 is lost and redone): the two metrics logs agree; returns the uninterrupted one."""
    from test_resume import comparable, kill_after_step

    run = [*run, "trainer.total_steps=4", "trainer.checkpoint_every=2", "trainer.eval_every=3"]
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    proc = run_train(run, ref_dir, cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kill_after_step(run, run_dir, cache, step=3)
    proc = subprocess.run([sys.executable, "-m", "grpo_lab.resume", str(run_dir)], cwd=REPO, env=dict(os.environ),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, reference = read_metrics(run_dir), read_metrics(ref_dir)
    assert [m["step"] for m in resumed] == [m["step"] for m in reference] == [0, 1, 2, 3, 4, 4]
    assert comparable(resumed) == comparable(reference)
    return reference


# ------------------------------------------------------------------ revision demonstrations


def test_demo_count_makes_the_demonstrations_the_asked_share():
    from grpo_lab.interaction.demos import demo_count

    assert demo_count(300, 0.0) == 0 and demo_count(300, 0.5) == 300 and demo_count(300, 0.25) == 100


@pytest.mark.parametrize("answer", ["-28", "7", "0", "cat"])
def test_wrong_answers_are_wrong_and_written_in_the_items_format(answer):
    import random

    from grpo_lab.interaction.verifier import wrong_answer

    rng, others = random.Random(0), [item("dog"), item("-28")]
    for fmt in ("plain", "hash"):
        for _ in range(50):
            wrong = wrong_answer(item(answer, fmt), rng, max_offset=10, others=others)
            assert verifier_message(wrong, item(answer, fmt)) not in ("correct", "wrong: no answer found")


def test_revision_demos_have_the_token_layout_of_a_second_turn():
    """prompt + wrong answer + <eos> + the environment's message (the multi-turn rollout's own format) ->
    the worked solution + <eos>; the message is the verifier's to that wrong answer."""
    from grpo_lab.interaction.demos import revision_demos

    tok = configure_tokenizer(build_char_tokenizer(CHARS))
    items = [item("-28"), item("-2", prompt="5-7=")]
    cfg = with_interaction(environment="verifier_feedback", warmup_revision_frac=0.5)
    demos = revision_demos(cfg, items, tok, seed=3)
    assert len(demos) == 2
    for prompt_ids, target_ids in demos:
        text = tok.decode(prompt_ids)
        question = next(it for it in items if text.startswith("<bos>" + it.prompt))
        wrong = text[len("<bos>" + question.prompt):].split("<eos>")[0]
        message = verifier_message(wrong, question)
        assert message != "correct"
        assert prompt_ids == (encode_prompt(tok, question.prompt) + tok.encode(wrong, add_special_tokens=False)
                              + [tok.eos_token_id] + environment_turn_ids(tok, message, answer_ids=[tok.eos_token_id]))
        assert target_ids == tok.encode(question.solution, add_special_tokens=False) + [tok.eos_token_id]
    off = with_interaction(environment="verifier_feedback", warmup_revision_frac=0.0)
    single = with_interaction(environment=None, warmup_revision_frac=0.5)
    assert revision_demos(off, items, tok, seed=3) == [] and revision_demos(with_interaction(), items, tok, seed=3) == []
    assert revision_demos(single, items, tok, seed=3) == []



def test_demonstrations_named_by_warmup_demos_from_are_shared_by_rows_of_any_environment():
    """interaction.warmup_demos_from writes the k-th demonstration in the words of the k-th named
    environment (cycling); a single-turn row, a verifier row and a critic row naming the same list get the
    same demonstrations and the same model alphabet, hence one warm-up checkpoint (its cache key)."""
    from grpo_lab.second_models.critic_llm import CriticEnvironment
    from grpo_lab.interaction.demos import revision_demos

    shared = ["verifier_feedback", "critic"]
    rows = [{"environment": env, "warmup_revision_frac": 0.5, "warmup_demos_from": shared}
            for env in (None, "verifier_feedback", "critic")]
    alphabets = {message_alphabet(interaction(**r)) for r in rows}
    assert len(alphabets) == 1
    union = alphabets.pop()
    assert set(message_alphabet(interaction(environment="verifier_feedback"))) | set(message_alphabet(
        interaction(environment="critic"))) == set(union)
    tok = configure_tokenizer(build_char_tokenizer("0123456789-=" + union))
    items = [item("-28"), item("-2", prompt="5-7="), item("7", prompt="9-2=")]
    demos = [revision_demos(with_interaction(**r), items, tok, seed=5) for r in rows]
    assert len(demos[0]) == 3 and demos[0] == demos[1] == demos[2]
    critic_cfg = with_interaction(**rows[2])
    for k, (prompt_ids, _) in enumerate(demos[0]):
        text = tok.decode(prompt_ids)
        question = next(it for it in items if text.startswith("<bos>" + it.prompt))
        wrong = text[len("<bos>" + question.prompt):].split("<eos>")[0]
        message = (verifier_message(wrong, question) if k % 2 == 0
                   else CriticEnvironment.demo_message(critic_cfg, question, wrong))
        assert text.endswith(tok.decode(environment_turn_ids(tok, message, answer_ids=[tok.eos_token_id]))), (k, text)
    # Without the list, each row writes its own environment's words (and a single-turn row none).
    own = [revision_demos(with_interaction(**{**r, "warmup_demos_from": None}), items, tok, seed=5)
           for r in rows]
    assert own[0] == [] and own[1] != own[2]


@pytest.mark.parametrize("overrides,key", [
    (["interaction.warmup_demos_from=[verifier_feedback]"], "interaction.warmup_revision_frac > 0"),
    (["interaction.warmup_revision_frac=0.5", "interaction.warmup_demos_from=[nope]"], "interaction.warmup_demos_from"),
    (["interaction.warmup_revision_frac=0.5", "interaction.warmup_demos_from=[interaction_plugins.Hint]"],
     "no demo_message"),
    (["interaction.warmup_revision_frac=0.5", "interaction.warmup_demos_from=[verifier_feedback]",
      "warmup.max_steps=0"], "warmup.max_steps=0"),
])
def test_bad_warmup_demos_from_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(make(overrides), machine=False)


def test_a_single_turn_row_with_demonstrations_validates_and_needs_references():
    cfg = make(["interaction.warmup_revision_frac=0.5", "interaction.warmup_demos_from=[verifier_feedback,critic]"])
    validate(cfg, machine=False)
    task = Task("t", {"train": [item("-28"), item(" ")], "dev": [item("1")], "test": [item("2")]})
    problem = reference_problem(cfg.interaction, task)
    assert "interaction.warmup_demos_from names verifier_feedback" in problem


def test_rows_naming_the_same_demonstrations_start_from_one_warm_up_checkpoint(tmp_path):
    """A single-turn row, a verifier row and a critic row with one interaction.warmup_demos_from build one
    warm-up (the second and third find the first's checkpoint); without the list each gets its own."""
    from grpo_lab.run_setup import start_run

    shared = ["interaction.warmup_revision_frac=0.5", "interaction.warmup_demos_from=[verifier_feedback,critic]"]
    rows = [["interaction=none"], ["interaction=verifier_feedback"], ["interaction=critic"]]
    # A short warm-up on few items: what is shared is the checkpoint's identity, not its quality.
    base = [*TINY_RUN, "task.train_size=200", "warmup.max_steps=10", "warmup.eval_every=10", f"cache_dir={tmp_path}"]

    def policy_dir(overrides):   # as a run starts: validated (which registers the critic), then built
        cfg = make([*base, *overrides])
        validate(cfg, machine=False)
        return start_run(cfg).policy_dir

    dirs = [policy_dir([*row, *shared]) for row in rows]
    assert dirs[0] == dirs[1] == dirs[2] and (dirs[0] / "config.json").exists()
    own = [policy_dir([*row, "interaction.warmup_revision_frac=0.5"]) for row in rows[1:]]
    assert len({*own, dirs[0]}) == 3


# ------------------------------------------------------------------ the critic LLM in the loop

# A short critic warm-up and an update every step, so that two steps train the critic once or twice.
CRITIC_RUN = ["rollout=hf", "interaction=critic", "interaction.warmup_revision_frac=0.5",
              "interaction.critic.warmup.max_steps=20", "interaction.critic.warmup.eval_every=10",
              "interaction.critic.warmup_dev_size=20", "interaction.critic.update_every=1",
              "interaction.critic.top_frac=0.25", "interaction.critic.bottom_frac=0.25"]


# The loop path is the same for every mode but the update (unit-tested in tests/test_critic_env.py); each
# costs the critic's warm-up, so all run in the slow tier (the default suite runs the critic in
# test_rows_naming_the_same_demonstrations_start_from_one_warm_up_checkpoint and tests/test_critic_env.py).
@pytest.mark.parametrize("mode", [pytest.param("false", marks=pytest.mark.slow),
                                  pytest.param("sft_top_bottom", marks=pytest.mark.slow),
                                  pytest.param("rl", marks=pytest.mark.slow)])
def test_two_steps_with_a_critic_llm(tmp_path, multi_turn_cache, monkeypatch, mode):
    """Each critic mode runs in the loop: the critic's metrics are logged, a trained critic updates, and the
    samples carry its feedback next to the first answer and the revision."""
    run_dir = tmp_path / "run"
    code = train_in_process([*TINY_RUN, *CRITIC_RUN, f"interaction.critic.train={mode}", "trainer.log_samples_every=1",
                             f"hydra.run.dir={run_dir}", f"cache_dir={multi_turn_cache}"], monkeypatch)
    assert code == 0, (run_dir / "summary.json").read_text() if (run_dir / "summary.json").exists() else code
    lines = read_metrics(run_dir)
    for m in lines[1:3]:
        assert {"critic_llm/verdict_acc", "critic_llm/examples", "critic_llm/updates", "interaction/first_acc"} <= set(m)
    gathered = sum(m["critic_llm/examples"] for m in lines[1:3])
    if mode == "false":
        assert lines[2]["critic_llm/updates"] == 0.0 and gathered == 0 and not any("critic_llm/loss" in m for m in lines)
    else:   # updates every step that gathered an example
        assert gathered > 0 and lines[2]["critic_llm/updates"] == sum(m["critic_llm/examples"] > 0 for m in lines[1:3])
        assert all(("critic_llm/loss" in m) == (m["critic_llm/examples"] > 0) for m in lines[1:3])
    rows = [json.loads(s) for s in (run_dir / "samples.jsonl").read_text().splitlines() if s.strip()]
    assert rows and all("turns" in r for r in rows)


@pytest.mark.slow
def test_kill_9_then_resume_with_a_trained_critic_equals_an_uninterrupted_run(tmp_path, multi_turn_cache, monkeypatch):
    """Exact resume covers both models: the critic's weights, optimizer and pending examples come back."""
    run = [*TINY_RUN, *CRITIC_RUN, "interaction.critic.train=sft_top_bottom", "interaction.critic.update_every=2"]
    reference = killed_and_resumed_equals_uninterrupted(run, tmp_path, multi_turn_cache)
    assert reference[4]["critic_llm/updates"] == 2.0   # updates at steps 2 and 4: one before the kill, one after
