"""The critic LLM environment (grpo_lab/second_models/critic_llm.py) on a tiny character-level critic: replies,
its synthetic-feedback warm-up, the top/bottom SFT and revision-reward RL updates, and exact resume."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from grpo_lab.interaction.base import EnvReply, StepRecord
from grpo_lab.second_models.critic_llm import CriticEnvironment, CriticLLMConfig, critic_config, feedback_format
from grpo_lab.interaction.critic_feedback import (FEEDBACK_FORMATS, KINDS, candidate_answer, revision_reward,
                                                  top_bottom, verifier_kind)
from grpo_lab.learner.batch import collate, completion_logits, token_logprobs
from grpo_lab.models import build_char_tokenizer
from grpo_lab.schema import ConfigError
from grpo_lab.tasks import Task, TaskItem

REPO = Path(__file__).resolve().parents[1]
# A task whose judging generalises to unseen questions in seconds: "n+0=" -> n. Checking a candidate is
# comparing it with the question's digits, which a tiny model learns quickly (sums would take minutes).
ITEMS = [TaskItem(f"{a}+0=", str(a), str(a), {"answer_format": "plain"}) for a in range(10, 200)]
random.Random(0).shuffle(ITEMS)
TASK = Task("identity", {"train": ITEMS[:150], "dev": ITEMS[150:], "test": []})
MODEL = {"builder": "tiny_llama", "hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 256,
         "max_position_embeddings": 64}
WARMUP = {"max_steps": 500, "batch_size": 64, "lr": 1e-3, "eval_every": 250}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("critic_cache")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def make_env(cache_dir, **critic) -> CriticEnvironment:
    section = {"model": MODEL, "warmup": WARMUP, "max_offset": 3, "warmup_pairs_per_item": 8, "warmup_dev_size": 40,
               "max_new_tokens": 6, **critic}
    cfg = OmegaConf.create({"seed": 0, "cache_dir": str(cache_dir), "interaction": {"critic": section}})
    return CriticEnvironment(cfg, tokenizer=None, task=TASK)


def held_out_pairs(n_per_item: int = 5) -> tuple[list[TaskItem], list[str]]:
    rng = random.Random(5)
    items = [it for it in TASK.splits["dev"] for _ in range(n_per_item)]
    return items, [candidate_answer(it, rng, max_offset=3, others=TASK.splits["dev"]) for it in items]


def verdict_accuracy(env: CriticEnvironment, items, answers) -> float:
    replies = env.reply(items, [[a] for a in answers], seed=0, greedy=True)
    right = [r.verdict is (verifier_kind(it, a) == "correct") for r, it, a in zip(replies, items, answers)]
    return sum(right) / len(right)


def step_record(items, first, replies: list[EnvReply], second) -> StepRecord:
    """What the rollout hands after_step: a revision (second[i]) only where the critic did not say correct."""
    answers = [[a] if r.done else [a, b] for a, b, r in zip(first, second, replies)]
    return StepRecord(items=list(items), group_ids=list(range(len(items))), answers=answers,
                      messages=[[] if r.done else [r.message] for r in replies],
                      turn_rewards=[[float(verifier_kind(it, x) == "correct") for x in ans]
                                    for it, ans in zip(items, answers)],
                      verdicts=[[] if r.done else [r.verdict] for r in replies])


def weights(env: CriticEnvironment) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in env.model.state_dict().items()}


def test_conf_file_types_and_matches_default_actor_size():
    conf = OmegaConf.load(REPO / "conf/interaction/critic.yaml")
    assert (conf.environment, conf.max_turns, conf.reward) == ("critic", 2, "final")
    c = critic_config(OmegaConf.create({"interaction": conf}))
    actor = OmegaConf.to_container(OmegaConf.load(REPO / "conf/model/tiny_llama.yaml"))
    assert OmegaConf.to_container(c.model) == {**OmegaConf.to_container(OmegaConf.structured(CriticLLMConfig).model),
                                               **actor}


@pytest.mark.parametrize("section, key", [({"train": "gan"}, "interaction.critic.train"),
                                          ({"top_frac": 1.5}, "top_frac"),
                                          ({"update_every": 0}, "update_every"),
                                          ({"sampler": "beam"}, "interaction.critic.sampler"),
                                          ({"model": {"builder": "pretrained"}}, "interaction.critic.model.path"),
                                          ({"lr_typo": 1.0}, "lr_typo")])
def test_bad_config_names_the_key_before_building(tmp_path, section, key):
    cfg = OmegaConf.create({"cache_dir": str(tmp_path), "interaction": {"critic": section}})
    with pytest.raises(ConfigError, match=key):
        CriticEnvironment(cfg, task=TASK)
    assert not any(tmp_path.iterdir())


def test_feedback_formats_write_and_read_every_kind():
    chat, compact, solve = (FEEDBACK_FORMATS[n] for n in ("chat", "compact", "solve_compact"))
    assert compact.prompt("15-43=", " -28\n") == solve.prompt("15-43=", " -28\n") == "15-43=-28|"
    assert chat.prompt("What is 2+2?", " 5 ") == ("Question: What is 2+2?\nAnswer: 5\nIs the answer correct? If not, "
                                                 "say what is wrong in one short sentence.")
    for fmt in (chat, compact, solve):
        assert [fmt.parse(fmt.target(k, "-28")) for k in KINDS] == [True, False, False, False]
    assert [solve.target(k, " -28") for k in KINDS] == ["-28C", "-28H", "-28L", "-28W"]
    assert [compact.target(k, "-28") for k in KINDS] == ["C", "H", "L", "W"]
    assert [chat.parse(t) for t in ("correct!", " Wrong: 4", "Incorrect, it is 4.", "Maybe.")] == [True, False, False,
                                                                                                 None]
    assert [compact.parse(t) for t in ("C", "H", "L", "W", "", "7")] == [True, False, False, False, None, None]
    assert [solve.parse(t) for t in ("-28C", "5H\n", "-2", "")] == [True, False, None, None]
    assert (solve.message(" -28H"), compact.message(" H"), chat.message(" Wrong. ")) == ("H", "H", "Wrong.")
    tokenizer = build_char_tokenizer("abc")
    assert feedback_format(tokenizer) is solve and feedback_format(tokenizer, "compact") is compact
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert feedback_format(tokenizer) is chat


def test_verifier_kind_reads_the_items_answer_format():
    tags = TaskItem("2+2=", "4", "<answer>4</answer>", {"answer_format": "tags"})
    assert [verifier_kind(tags, a) for a in ("<answer>4</answer>", "<answer>7</answer>", "<answer>-1</answer>", "4",
                                             "<answer>four</answer>")] == ["correct", "too_high", "too_low",
                                                                           "wrong", "wrong"]
    word = TaskItem("colour?", "red", "red", {"answer_format": "plain"})
    assert (verifier_kind(word, " red"), verifier_kind(word, "blue")) == ("correct", "wrong")


def test_reply_is_well_formed_deterministic_and_leaves_global_rng(cache_dir):
    env = make_env(cache_dir)
    items = TASK.splits["dev"][:4]
    conversations = [[it.answer] for it in items[:2]] + [["7", "H", it.answer] for it in items[2:]]
    rng = torch.get_rng_state()
    for greedy in (True, False):
        replies = env.reply(items, conversations, seed=3, greedy=greedy)
        assert len(replies) == 4 and all(isinstance(r, EnvReply) for r in replies)
        for r in replies:
            assert r.verdict in (True, False, None) and r.done == (r.verdict is True)
            assert (r.message is None) == r.done and isinstance(r.info["critic_text"], str)
            assert r.verdict == env.format.parse(r.info["critic_text"])
            assert r.done or r.message == env.format.message(r.info["critic_text"])
        assert env.reply(items, conversations, seed=3, greedy=greedy) == replies
    assert torch.equal(torch.get_rng_state(), rng)
    assert env.reply([], [], seed=0, greedy=True) == []


def test_warmup_judges_held_out_pairs_well_above_chance_and_is_cached(cache_dir):
    items, answers = held_out_pairs()
    majority = max(p := sum(verifier_kind(it, a) == "correct" for it, a in zip(items, answers)) / len(items), 1 - p)
    untrained = verdict_accuracy(make_env(cache_dir, warmup={"max_steps": 0}), items, answers)
    env = make_env(cache_dir)
    warmed = verdict_accuracy(env, items, answers)
    assert majority < 0.6 and untrained < 0.6          # neither a constant nor a random critic reaches the bar
    assert warmed >= 0.75, (warmed, untrained, majority)
    assert make_env(cache_dir).warmup_stats["cached"] is True


def test_top_bottom_takes_floor_fractions_and_breaks_boundary_ties_at_random():
    rewards = [1.0, 0.5, 0.5, 0.0, 1.0, 0.5, 0.0, 0.0, 0.2, 0.5]
    gen = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    assert top_bottom(rewards, 0.2, 0.2, gen(0)) == ([0, 4], sorted(top_bottom(rewards, 0.2, 0.2, gen(0))[1]))
    assert set(top_bottom(rewards, 0.2, 0.2, gen(0))[1]) < {3, 6, 7}          # 3 tied at 0.0, 2 taken
    picks = {tuple(top_bottom(rewards, 0.3, 0.1, gen(s))[0]) for s in range(40)}
    assert all(len(p) == 3 and {0, 4} < set(p) and len(set(p) & {1, 2, 5, 9}) == 1 for p in picks)
    assert len(picks) > 1                                                    # the tie is not broken by position
    assert top_bottom(rewards, 0.3, 0.1, gen(7)) == top_bottom(rewards, 0.3, 0.1, gen(7))
    assert top_bottom([1.0] * 10, 0.5, 0.5, gen(0)) == ([], [])              # all agree: nothing to learn
    assert top_bottom([1.0, 0.0, 0.0, 0.0], 0.5, 0.5, gen(0))[0] == [0]     # the minimum is never a positive


def test_sft_top_bottom_gathers_the_expected_examples_and_updates_every_kth_step(cache_dir):
    env = make_env(cache_dir, train="sft_top_bottom", top_frac=0.25, bottom_frac=0.25, update_every=2, lr=1e-3)
    items = TASK.splits["train"][:8]
    first = [it.answer for it in items[:3]] + [str(int(it.answer) + 1) for it in items[3:]]
    replies = env.reply(items, [[a] for a in first], seed=1, greedy=False)
    record = step_record(items, first, replies, first)
    record.turn_rewards[0][0], record.turn_rewards[7][0] = 2.0, -1.0        # a unique best and worst answer
    before = weights(env)
    metrics = env.after_step(1, record)
    fmt = env.format
    example = lambda i, kind: (fmt.prompt(items[i].prompt, first[i]), fmt.target(kind, items[i].answer))  # noqa: E731
    expected = {example(0, "correct"), example(7, "wrong")}
    pending = {(e["prompt"], e["target"]) for e in env.pending}
    assert fmt.name == "solve_compact" and example(7, "wrong")[1] == items[7].answer + "W"
    assert len(env.pending) == 4 and expected < pending                      # floor(0.25 * 8) = 2 each
    tied_top = {example(i, "correct") for i in (1, 2)}
    tied_bottom = {example(i, "wrong") for i in range(3, 7)}
    assert len(pending & tied_top) == 1 and len(pending & tied_bottom) == 1
    assert metrics["critic_llm/examples"] == 4 and metrics["critic_llm/updates"] == 0 and "critic_llm/loss" not in metrics
    assert all(torch.equal(before[k], v) for k, v in weights(env).items())
    env.reply(items, [[a] for a in first], seed=2, greedy=False)
    metrics = env.after_step(2, record)
    assert metrics["critic_llm/updates"] == 1 and torch.isfinite(torch.tensor(metrics["critic_llm/loss"]))
    assert env.pending == [] and any(not torch.equal(before[k], v) for k, v in weights(env).items())
    assert 0.0 <= metrics["critic_llm/verdict_acc"] <= 1.0 and metrics["critic_llm/feedback_len"] >= 1
    assert "critic_llm/loss" not in env.after_step(3, record) and env.updates == 1


def sequence_logprob(env: CriticEnvironment, prompt_ids: list[int], completion_ids: list[int]) -> float:
    with torch.no_grad():
        batch = collate([prompt_ids], [completion_ids], env.tokenizer.pad_token_id)
        return float(token_logprobs(completion_logits(env.model, batch), batch["completion_ids"]).sum())


def test_rl_update_raises_the_logprob_of_rewarded_feedback(cache_dir):
    # An untrained critic writes varied one-token feedback; the feedback after which the actor's revision
    # turned wrong into right (+1) must become likelier, the others (0) do not earn it.
    env = make_env(cache_dir, warmup={"max_steps": 0}, train="rl", update_every=1, rl_steps=1, lr=1e-2,
                   agreement_coef=0.0, max_new_tokens=1, batch_size=64)
    items = TASK.splits["train"][:1] * 24
    wrong = str(int(items[0].answer) + 1)
    replies = env.reply(items, [[wrong]] * 24, seed=11, greedy=False)
    texts = [r.info["critic_text"] for r in replies if not r.done]
    rewarded = max(set(texts), key=texts.count)
    assert 0 < texts.count(rewarded) < 24, texts
    entry = next(e for e in env.stash[next(iter(env.stash))] if e["message"] == env.format.message(rewarded))
    before = sequence_logprob(env, entry["prompt_ids"], entry["completion_ids"])
    second = [items[0].answer if r.info["critic_text"] == rewarded else wrong for r in replies]
    metrics = env.after_step(1, step_record(items, [wrong] * 24, replies, second))
    assert metrics["critic_llm/examples"] == 24 and metrics["critic_llm/updates"] == 1
    assert sequence_logprob(env, entry["prompt_ids"], entry["completion_ids"]) > before + 0.05


def test_revision_reward():
    assert revision_reward(False, True, False, 0.2) == 1.0
    assert revision_reward(True, False, False, 0.2) == -1.0
    assert revision_reward(True, None, True, 0.2) == 0.2 and revision_reward(False, False, True, 0.0) == 0.0


def run_steps(env: CriticEnvironment, steps: range) -> list[list[EnvReply]]:
    """Sampled replies to a fixed batch, then after_step with the actor's revision right half the time."""
    items = TASK.splits["train"][:16]
    first = [it.answer if i % 3 == 0 else str(int(it.answer) + 2) for i, it in enumerate(items)]
    out = []
    for step in steps:
        replies = env.reply(items, [[a] for a in first], seed=step, greedy=False)
        second = [it.answer if (i + step) % 2 else a for i, (it, a) in enumerate(zip(items, first))]
        env.after_step(step, step_record(items, first, replies, second))
        out.append(replies)
    return out


@pytest.mark.parametrize("train", ["sft_top_bottom", "rl"])
def test_state_dict_round_trip_continues_exactly(cache_dir, train):
    settings = dict(train=train, update_every=2, lr=1e-3, top_frac=0.25, bottom_frac=0.25, temperature=2.0)
    original, resumed = make_env(cache_dir, **settings), make_env(cache_dir, **settings)
    run_steps(original, range(1, 4))
    assert original.updates == 1 and original.pending                       # saved mid-way between updates
    state = original.state_dict()
    resumed.load_state_dict(state)
    after_original, after_resumed = run_steps(original, range(4, 7)), run_steps(resumed, range(4, 7))
    assert after_original == after_resumed and original.updates == resumed.updates == 3
    assert all(torch.equal(v, weights(resumed)[k]) for k, v in weights(original).items())
    with pytest.raises(ConfigError, match="interaction.critic.train"):
        make_env(cache_dir, train="rl" if train != "rl" else "sft_top_bottom").load_state_dict(state)
