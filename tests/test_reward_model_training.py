"""Learned reward models end to end: preference files refused line by line, pairs made from a policy's samples
and a gold scorer, held-out metrics by hand, the ensemble and normalisation rules by hand, and a run that
trains its own reward model and optimises against it (proxy and gold different numbers, KL logged)."""

import json
import math
import random

import pytest
import torch
from helpers import TINY_RUN, read_metrics, run_train

from grpo_lab.rewards.reward_model import combine_members, normalize_scores
from grpo_lab.schema import ConfigError
from grpo_lab.second_models.preference_data import RankedGroup, groups_from_scores, read_preferences, swap_labels
from grpo_lab.second_models.reward_model_training import preference_metrics


# ------------------------------------------------------------------------------------------- the data
def write_lines(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_a_preference_file_reads_pairs_with_margins_and_ranked_groups(tmp_path):
    f = write_lines(tmp_path / "p.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 1.5}, "",
                                           {"prompt": "2+2=", "ranked": ["4", "5", "40"]}])
    pair, ranked = read_preferences(f)
    assert (pair.prompt, pair.completions, pair.margin, pair.source) == ("1+1=", ("2", "3"), 1.5, f"{f}:1")
    assert (ranked.completions, ranked.margin, ranked.source) == (("4", "5", "40"), None, f"{f}:3")


@pytest.mark.parametrize("line, problem", [
    ("{not json", "not JSON"),
    ({"chosen": "2", "rejected": "3"}, 'no "prompt"'),
    ({"prompt": "1+1=", "chosen": "2"}, '"rejected"'),
    ({"prompt": "1+1=", "chosen": "2", "rejected": "2"}, "tie"),
    ({"prompt": "1+1=", "chosen": "  ", "rejected": "3"}, "empty completion"),
    ({"prompt": "1+1=", "ranked": ["4"]}, "at least two"),
    ({"prompt": "1+1=", "ranked": ["4", "5", "4"]}, "tie"),
    ({"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": "big"}, "margin"),
    ([1, 2], "not a JSON object"),
])
def test_bad_preference_lines_are_refused_naming_file_and_line(tmp_path, line, problem):
    f = write_lines(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, line])
    with pytest.raises(ConfigError) as err:
        read_preferences(f)
    assert f"{f}:2:" in str(err.value) and problem in str(err.value)


def test_a_missing_or_empty_preference_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        read_preferences(tmp_path / "none.jsonl")
    with pytest.raises(ConfigError, match="holds no preferences"):
        read_preferences(write_lines(tmp_path / "empty.jsonl", [""]))


def test_pairs_from_gold_scores_by_hand():
    """Texts a (gold 1), b (0), a again, c (0.5): the distinct texts give pairs (a>b), (a>c), (c>b); equal
    scores (none here besides the repeated a) make no pair; the margin is margin_scale x the gold gap."""
    groups = groups_from_scores(["p"], [["a", "b", "a", "c"]], [[1.0, 0.0, 1.0, 0.5]], form="pairs", n=10,
                                rng=random.Random(0), margin_scale=2.0)
    assert sorted((g.completions, g.margin) for g in groups) == [(("a", "b"), 2.0), (("a", "c"), 1.0),
                                                                 (("c", "b"), 1.0)]
    ranked = groups_from_scores(["p"], [["b", "a", "c", "d"]], [[0.0, 1.0, 0.5, 0.0]], form="ranked", n=10,
                                rng=random.Random(0))
    assert [g.completions for g in ranked] == [("a", "c", "b")]   # one text per distinct score, best first
    # A group whose scores agree gives nothing; the budget n draws from all candidates.
    assert groups_from_scores(["p"], [["a", "b"]], [[1.0, 1.0]], form="pairs", n=5, rng=random.Random(0)) == []
    assert len(groups_from_scores(["p"], [["a", "b", "c"]], [[2.0, 1.0, 0.0]], form="pairs", n=2,
                                  rng=random.Random(0))) == 2


def test_label_noise_swaps_about_p_of_the_pairs():
    groups = [RankedGroup("p", ("w", "l"))] * 4000
    noisy, swapped = swap_labels(groups, 0.2, random.Random(0))
    assert swapped == sum(g.completions == ("l", "w") for g in noisy)
    assert abs(swapped / 4000 - 0.2) < 0.02
    assert swap_labels(groups, 0.0, random.Random(0))[1] == 0


# ----------------------------------------------------------------------------------------- the metrics
def test_held_out_metrics_by_hand():
    """Two pairs with score gaps +2 and -1, and a ranking (3 texts) with scores 3 > 1 > 2."""
    pair1 = (RankedGroup("p", ("aa", "b")), [2.0, 0.0])        # right, gap 2
    pair2 = (RankedGroup("p", ("c", "dddd")), [0.0, 1.0])      # wrong, gap -1
    ranked = (RankedGroup("p", ("x", "yy", "zzz")), [3.0, 1.0, 2.0])   # pairs: +2 right, +1 right, -1 wrong
    m = preference_metrics([pair1, pair2, ranked])
    assert m["accuracy"] == pytest.approx(3 / 5)
    assert m["margin"] == pytest.approx((2 - 1 + 2 + 1 - 1) / 5)
    # Calibration of one pair with gap 0: p = 0.5 both ways, outcomes 1 and 0: perfectly calibrated.
    assert preference_metrics([(RankedGroup("p", ("a", "b")), [1.0, 1.0])])["ece"] == pytest.approx(0.0)
    # One pair with a huge gap: p ~ 1 with outcome 1 and p ~ 0 with outcome 0: calibrated too.
    assert preference_metrics([(RankedGroup("p", ("a", "b")), [50.0, 0.0])])["ece"] == pytest.approx(0.0, abs=1e-9)
    # Gap 1 everywhere: p = sigma(1) = 0.731 with outcome 1 (bin 7), 0.269 with outcome 0 (bin 2): ECE = 0.269.
    gap1 = preference_metrics([(RankedGroup("p", ("a", "b")), [1.0, 0.0])] * 3)
    assert gap1["ece"] == pytest.approx(1 - 1 / (1 + math.exp(-1)))
    # Score = length exactly: correlation 1.
    lengthy = [(RankedGroup("p", ("aaa", "a")), [3.0, 1.0]), (RankedGroup("p", ("aa", "aaaa")), [2.0, 4.0])]
    assert preference_metrics(lengthy)["length_corr"] == pytest.approx(1.0)


# ----------------------------------------------------------------------------- ensembles and normalising
def test_ensemble_rules_by_hand():
    scores = torch.tensor([[1.0, 4.0], [3.0, 0.0]])     # 2 members x 2 samples
    assert combine_members(scores, "mean").tolist() == [2.0, 2.0]
    assert combine_members(scores, "min").tolist() == [1.0, 0.0]
    # population std over members: 1 and 2; mean - 0.5 std
    assert combine_members(scores, "mean_minus_std", 0.5).tolist() == [1.5, 1.0]


def test_normalisation_by_hand():
    v = torch.tensor([1.0, 3.0, 10.0, 10.0, 20.0])
    assert normalize_scores(v, "none").tolist() == v.tolist()
    z = normalize_scores(v, "batch")
    assert float(z.mean()) == pytest.approx(0.0, abs=1e-6) and float(z.std(unbiased=False)) == pytest.approx(1.0, abs=1e-4)
    g = normalize_scores(v, "group", ["a", "a", "b", "b", "c"])
    assert g.tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0, 0.0], abs=1e-5)   # equal pair -> 0; a group of one -> 0


# ------------------------------------------------------------------------------------------ refusals
def compose(*overrides):
    from hydra import compose as hydra_compose, initialize_config_dir
    from helpers import REPO

    from grpo_lab.config import register_configs

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        return hydra_compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("overrides, message", [
    (["reward_model.data.source=jsonl"], "needs reward_model.data.path"),
    (["reward_model.data.source=jsonl", "reward_model.data.path=/nonexistent/p.jsonl"], "no such file"),
    (["reward_model.loss=hinge"], "not a ranking loss"),
    (["reward_model.data.gold=nope"], "not a registered reward"),
    (["reward_model.data.label_noise=0.6"], "label_noise"),
    (["reward_model.trunk=path", "reward_model.path=/nonexistent/model"], "not a directory"),
    (["reward=reward_model", "reward.reward_model.normalize=running"], "reward_ema_decay"),
    (["reward=reward_model", "reward.reward_model.dirs=[/nonexistent/rm]"], "holds no saved reward model"),
    (["reward=reward_model", "reward.reward_model.dtype=fp16"], "must be one of fp32, bf16"),
    (["reward=reward_model", "reward.reward_model.dtype=bf16", "reward_model.refresh_every=5"],
     "trains the scoring models in fp32"),
])
def test_bad_reward_model_settings_are_refused_before_anything_loads(overrides, message):
    from grpo_lab.config import validate

    with pytest.raises(ConfigError, match=message):
        validate(compose(*overrides))


def test_train_reward_model_takes_v_off_the_command_line_as_a_run_does(tmp_path):
    """`python -m grpo_lab.train_reward_model -v ...` is not refused by Hydra (which has no -v): the entry point
    takes it off the command line and keeps the libraries quiet without it, as `python -m grpo_lab.train`."""
    import subprocess
    import sys

    from helpers import REPO

    proc = subprocess.run([sys.executable, "-m", "grpo_lab.train_reward_model", "-v", "reward_model.lr=-1",
                           f"hydra.run.dir={tmp_path / 'rm'}", f"cache_dir={tmp_path / 'cache'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "reward_model.lr=-1.0 must be > 0" in proc.stderr, proc.stderr[-2000:]
    assert "unrecognized arguments" not in proc.stderr and not (tmp_path / "cache").exists()


# ------------------------------------------------------------------------------------------- end to end
def test_a_run_trains_its_reward_model_and_logs_proxy_gold_and_kl(warm_cache, tmp_path):
    """experiment=rlhf_tiny, 2 steps (reward=reward_model with no dirs): the run trains the reward model on the warm-up's labelled samples
    (cached), optimises against it, and logs the proxy (reward/reward_model, eval/proxy_reward) beside the gold
    (reward/correct_frac, eval/accuracy) and KL(pi || pi_ref) of each step's samples; a second run finds it cached."""
    rm = ["experiment=rlhf_tiny", "trainer.eval_every=1", "reward_model.data.pairs=200",
          "reward_model.data.held_out_pairs=50", "reward_model.max_steps=20", "reward_model.eval_every=10"]
    proc = run_train([*TINY_RUN, *rm], tmp_path / "run", warm_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(tmp_path / "run")
    steps = [m for m in lines if "reward/reward_model" in m]
    assert len(steps) == 2
    assert all(m["reward/reward_model"] != m["reward/correct_frac"] for m in steps)
    assert steps[0]["kl_ref/seq"] == pytest.approx(0.0, abs=1e-4)   # the policy is the reference at step 1
    assert all("eval/proxy_reward" in m and "eval/accuracy" in m for m in lines if "eval/accuracy" in m)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0.0 <= summary["prepared_rewards"]["reward_model"]["held_out_accuracy"] <= 1.0
    rm_dir = summary["prepared_rewards"]["reward_model"]["dir"]
    again = run_train([*TINY_RUN, *rm, "trainer.total_steps=0"], tmp_path / "again", warm_cache)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"reward model: cached {rm_dir}" in again.stdout


@pytest.mark.slow
def test_kill_9_then_resume_with_an_online_reward_model_refresh_equals_an_uninterrupted_run(warm_cache, tmp_path):
    """reward_model.refresh_every=1: the reward model trains on every step's relabelled samples; its weights and
    optimizer are in the checkpoints, so a run killed after step 3 and resumed from step 2 logs what an
    uninterrupted run logs, line for line (timings aside)."""
    import os
    import subprocess
    import sys

    from helpers import REPO
    from test_resume import comparable, kill_after_step

    run = [*TINY_RUN, "reward=reward_model", "rollout=hf", "trainer.total_steps=4", "trainer.checkpoint_every=2",
           "trainer.eval_every=2", "reward_model.data.pairs=200", "reward_model.data.held_out_pairs=50",
           "reward_model.max_steps=20", "reward_model.eval_every=10", "reward_model.refresh_every=1",
           "reward_model.refresh_pairs=16"]
    ref = run_train(run, tmp_path / "ref", warm_cache)
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = read_metrics(tmp_path / "ref")
    assert all(m["reward_model/refreshes"] == m["step"] for m in reference if "reward_model/refreshes" in m)
    kill_after_step(run, tmp_path / "killed", warm_cache, step=3)
    proc = subprocess.run([sys.executable, "-m", "grpo_lab.resume", str(tmp_path / "killed")], cwd=REPO,
                          env={**os.environ, "WANDB_MODE": "offline"}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert comparable(read_metrics(tmp_path / "killed")) == comparable(reference)


@pytest.mark.slow
def test_the_smollm2_rlhf_recipe_runs_two_steps(tmp_path):
    """experiment=rlhf_smollm2 at a toy budget: a LoRA reward model on SmolLM2-135M-Instruct (its chat template,
    a scalar head) trained on the instruct model's own labelled samples, then 2 GRPO steps against it on vLLM."""
    tiny = ["logger=none", "trainer.total_steps=2", "trainer.prompts_per_step=4", "rollout.group_size=4",
            "trainer.eval_every=0", "task.dev_size=16", "task.test_size=8", "task.train_size=2000",
            "task.min_distinct_train_prompts=0", "reward_model.data.pairs=24", "reward_model.data.held_out_pairs=8",
            "reward_model.max_steps=4", "reward_model.eval_every=2", "reward_model.batch_size=8",
            "reward_model.data.engine=hf", "trainer.checkpoint_every=0"]
    proc = run_train(["experiment=rlhf_smollm2", *tiny], tmp_path / "run", tmp_path / "cache", timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [m for m in read_metrics(tmp_path / "run") if "reward/reward_model" in m]
    assert len(steps) == 2 and all("kl_ref/seq" in m for m in steps)
    member = json.loads((tmp_path / "run" / "summary.json").read_text())["prepared_rewards"]["reward_model"]["dir"]
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(f"{member}/member_0")
    assert model.config.num_labels == 1
