"""Each table's rows are the runs they say they are, at every scale. A row is composed from its table
file and, at --scale full, the table's conf/experiment recipe instead of `fixed`; the noise table once
kept reward.noise.kind=flip in `fixed` only, so its full-scale rows would have trained with no noise at
all at every flip rate (and noise_remedy's rows with GRPO instead of DPO), and every job still
validated. Here, with nothing trained, each row of each table at lab, full and smoke scale must (1) hold
every override the table gives it (its variant's, its sweep values, `fixed`/`every_scale`, a group
override by the group it chose), (2) set what its name and the table's text claim (CLAIMS) and (3)
validate, the unread-settings rule included. That make_table's own preflight composes and validates a table's
jobs (and counts them) is test_tables.py's."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator

import pytest
from helpers import REPO
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from grpo_lab.config import finalize, register_configs, validate
from grpo_lab.schema import ConfigError, CriticLLMConfig
from grpo_lab.tables.plan import Plan, make_plan, write_variant_files
from grpo_lab.tables.spec import CONF, VARIANT_GROUP, load_spec, override_key, overrides_parser

TABLES = sorted(p.stem for p in (REPO / "conf" / "table").glob("*.yaml"))
# (scale, smoke) of make_table: --scale lab|full, and SMOKE=1 on the lab scale (the suite's smoke runs).
SCALES = {"lab": ("lab", False), "full": ("full", False), "smoke": ("lab", True)}
QWEN_CRITIC = "/models/Qwen2.5-1.5B-Instruct"
_NUM = r"(\d+(?:\.\d+)?)"


def _p(name: str) -> float:
    """A row's rate from its name: p0.2 -> 0.2, cdpo_p0.3 -> 0.3."""
    return float(re.search(rf"p{_NUM}$", name).group(1))


def _noise(row: dict, scale: str) -> dict:
    return {"reward.noise.kind": "flip", "reward.noise.flip_prob": _p(row["variant"]), "algorithm.name": row["algorithm"]}


def _noise_remedy(row: dict, scale: str) -> dict:
    loss, p = row["variant"].split("_p")[0], _p(row["variant"])
    return {"algorithm.name": "dpo", "algorithm.objective": "preference", "reward.noise.kind": "none",
            "algorithm.preference.loss": "rdpo" if loss == "rdpo" else "dpo",
            "algorithm.preference.label_flip_prob": p,
            "algorithm.preference.label_smoothing": 0.0 if loss == "dpo" else p}   # cDPO/rDPO are told eps = p


def _noise_length(row: dict, scale: str) -> dict:
    judged = row["variant"] == "judge_len"
    return {"algorithm.name": row["algorithm"], "reward.noise.kind": "judge_like" if judged else "none",
            **({"reward.noise.length_bias": 0.5} if judged else {})}


def _critique(row: dict, scale: str) -> dict:
    name = row["variant"]
    if not name.startswith("critic_"):
        # No critic: the row carries none of its settings (the smoke set shrinks the critic's warm-up
        # for every row: the lab rows' revision demonstrations are written in the critic's words too).
        critic = {} if scale == "smoke" else {"interaction.critic": _default_critic()}
        return {"interaction.environment": {"single_turn": None, "verifier": "verifier_feedback"}[name], **critic}
    train = {"frozen": False, "sft": "sft_top_bottom", "rl": "rl"}[name.split("_")[1]]
    k = re.search(r"_k(\d+)$", name)
    model = ({"interaction.critic.model.builder": "pretrained", "interaction.critic.model.path": QWEN_CRITIC}
             if scale == "full" else {"interaction.critic.model.builder": "tiny_llama"})
    return {"interaction.environment": "critic", "interaction.max_turns": 2, "interaction.critic.train": train,
            **({"interaction.critic.update_every": int(k.group(1))} if k else {}), **model}


def _kl(row: dict, scale: str) -> dict:
    m = re.fullmatch(rf"(k\d)_b{_NUM}", row["variant"])
    coef, estimator = (float(m.group(2)), m.group(1)) if m else (0.0, "k3")    # no_kl
    return {"algorithm.kl.placement": "loss", "algorithm.kl.coef": coef, "algorithm.kl.estimator": estimator}


def _clip(row: dict, scale: str) -> dict:
    eps = float(row["algorithm.clip_low"])
    return {"algorithm.clip_low": eps, "algorithm.clip_high": eps, "algorithm.epochs": int(row["algorithm.epochs"]),
            "algorithm.minibatches": 4}   # symmetric, and 4 minibatches so that clipping acts at 1 epoch too


DAPO_LADDER = ["grpo", "overlong_filtering", "clip_higher", "soft_overlong_punishment", "token_level_loss",
               "dynamic_sampling"]


def _dapo(row: dict, scale: str) -> dict:
    rung = DAPO_LADDER.index(row["variant"])
    return {"algorithm.overlong.filter": rung >= 1, "algorithm.clip_high": 0.28 if rung >= 2 else 0.2,
            "algorithm.overlong.soft_buffer": (4096 if scale == "full" else 2) if rung >= 3 else 0,
            "algorithm.aggregation": "token_mean" if rung >= 4 else "seq_mean_token_mean",
            "algorithm.dynamic_sampling.enabled": rung >= 5}


def _group_size(row: dict, scale: str) -> dict:
    g = int(row["variant"][1:])
    samples_per_step = 2048 if scale == "full" else 256     # the budget every row shares
    return {"rollout.group_size": g, "trainer.prompts_per_step": samples_per_step // g}


def _async(row: dict, scale: str) -> dict:
    return {"trainer.max_staleness": 0 if row["variant"] == "sync" else 1,
            **({"trainer.backend": "engine_process"} if row["variant"].endswith("engine_process") else {})}


def _std_norm(row: dict, scale: str) -> dict:
    return {"algorithm.advantage": {"group_std": "group_zscore", "no_std": "group_mean",
                                    "batch_std": "group_mean_batch_std"}[row["variant"]]}


def _algorithm_rows(row: dict, scale: str) -> dict:
    return {"algorithm.name": row["variant"]}     # a task sweep: its task=<file> is held (the group chosen)


def _overoptimization(row: dict, scale: str) -> dict:
    """<algorithm>_<good|weak>[_ensemble|_kl]: against a learned reward model, KL tracked; weak = 20 % swapped
    labels; the ensemble row 3 members under mean - std; the KL row beta 0.05."""
    algo = re.match(r"(grpo|ppo|rloo|group_dpo)_", row["variant"]).group(1)
    name = row["variant"]
    return {"algorithm.name": algo, "reward.weights": {"reward_model": 1.0}, "algorithm.kl.track": True,
            "reward_model.data.label_noise": 0.2 if "_weak" in name else 0.0,
            "reward_model.ensemble_size": 3 if name.endswith("_ensemble") else 1,
            "reward.reward_model.ensemble": "mean_minus_std" if name.endswith("_ensemble") else "mean",
            **({"algorithm.kl.coef": 0.05} if name.endswith("_kl") else {})}



def _losses(row: dict, scale: str) -> dict:
    """Each row its algorithm's recipe, and 4 minibatches a step for all (without which no trust region acts)."""
    return {"algorithm.name": row["variant"], "algorithm.minibatches": 4}


def _mismatch(row: dict, scale: str) -> dict:
    """none / token_tis / seq_mis / geo_mask: GRPO with only algorithm.rollout_correction changed."""
    level, mode, lower, upper = {"none": (None, "truncate", None, None), "token_tis": ("token", "truncate", None, 2.0),
                                 "seq_mis": ("sequence", "mask", 0.5, 2.0),
                                 "geo_mask": ("geometric", "mask", 0.98, 1.02)}[row["variant"]]
    out = {"algorithm.name": "grpo", "algorithm.rollout_correction.level": level,
           **({"learner.dtype": "fp32", "rollout.dtype": "bfloat16"} if scale != "full" else {})}
    if level is not None:
        out.update({"algorithm.rollout_correction.mode": mode, "algorithm.rollout_correction.upper": upper,
                    **({"algorithm.rollout_correction.lower": lower} if lower is not None else {})})
    return out


def _tools(row: dict, scale: str) -> dict:
    """single_turn / tool / tool_rl_only / tool_rloo: the sandboxed tool or none; at lab scale the tool rows'
    warm-up demonstrates calls except the RL-only one's (at full scale the RL-only row's system prompt drops
    the recipe's fenced example instead, checked as its override)."""
    name = row["variant"]
    if name == "single_turn":
        return {"interaction.environment": None, "interaction.max_turns": 1, "algorithm.name": "grpo"}
    out = {"interaction.environment": "python_tool", "algorithm.name": "rloo" if name == "tool_rloo" else "grpo"}
    if scale != "full":
        out["interaction.warmup_tool_frac"] = 0.0 if name == "tool_rl_only" else 0.5
    return out

# Table -> what a row (its variant name and sweep values) claims its composed run sets, by scale
# ("lab", "full", "smoke"). A new table says here what its rows are.
CLAIMS: dict[str, Callable[[dict, str], dict]] = {
    "noise": _noise, "noise_remedy": _noise_remedy, "noise_length": _noise_length, "critique": _critique,
    "kl": _kl, "clip": _clip, "dapo": _dapo, "group_size": _group_size, "async": _async, "std_norm": _std_norm,
    "algorithms": _algorithm_rows, "smollm2": _algorithm_rows, "tasks": _algorithm_rows,
    "overoptimization": _overoptimization, "losses": _losses, "mismatch": _mismatch,
    "tools": _tools,
}


def _default_critic() -> dict:
    return OmegaConf.to_container(OmegaConf.structured(CriticLLMConfig), resolve=True)


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


@dataclasses.dataclass
class Row:
    job: list[str]
    values: dict                # its variant and sweep values: {"variant": "p0.1", "algorithm": "grpo"}
    overrides: list[str]        # every override the table gives this job (its variant's included)
    choices: dict               # config group -> the option the composed run chose
    cfg: DictConfig


def rows(plan: Plan) -> Iterator[Row]:
    """Each row of `plan` (its first seed), composed from the conf/ tree the trainer reads."""
    write_variant_files(plan)
    variants = {v.name: ov for v, ov in plan.variants}
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for job in plan.jobs():
            if f"seed={plan.seeds[0]}" not in job:
                continue
            extra = [plan.searchpath_override()] if plan.variants else []
            raw = compose("config", overrides=extra + job, return_hydra_config=True)
            choices = dict(raw.hydra.runtime.choices)
            with open_dict(raw):
                del raw["hydra"]
            own = [o for o in job if o not in plan.base and not o.startswith("seed=")]
            values = {override_key(o): o.split("=", 1)[1] for o in own}     # {"variant": ..., sweep key: ...}
            # The command line beats a variant's file: a smoke override of a variant's key (dapo's
            # dynamic-sampling rounds) is the job's value (load_spec refuses `fixed`/`every_scale` ones).
            base_keys = {override_key(o) for o in plan.base}
            variant = [o for o in variants.get(values.get(VARIANT_GROUP), []) if override_key(o) not in base_keys]
            yield Row(job, values, [*job, *variant], choices, finalize(raw))


def not_held(row: Row) -> list[str]:
    """The overrides of `row` its composed run does not hold, each with what it holds instead."""
    parser, out = overrides_parser(), []
    for o in row.overrides:
        ov, key = parser.parse_override(o), override_key(o)
        want = ov.value()
        if (CONF / key).is_dir() or key == VARIANT_GROUP:     # a group: the option chosen
            have = row.choices.get(key)
        else:
            have = _plain(OmegaConf.select(row.cfg, key))
            if isinstance(want, str) and "${" in want:         # an interpolation: what it resolves to
                want = OmegaConf.create({**OmegaConf.to_container(row.cfg), "_want": want})._want
            want = _plain(want)
        if have != want:
            out.append(f"{o} (the run has {have!r})")
    return out


def unmet(row: Row, claims: dict) -> list[str]:
    out = []
    for key, want in claims.items():
        have = _plain(OmegaConf.select(row.cfg, key, default="<missing>"))
        if have != want:
            out.append(f"{key}: claimed {want!r}, the run has {have!r}")
    return out


def test_every_table_says_what_its_rows_claim():
    assert sorted(CLAIMS) == TABLES, "add the new table's row claims to CLAIMS (what each row's run sets)"


# The smoke scale is the lab scale at tiny budgets (its jobs are validated by test_tables.py's preflight test
# in the default tier too), so its claims run with the slow tests.
@pytest.mark.parametrize("scale", [pytest.param(s, marks=pytest.mark.slow) if s == "smoke" else s for s in sorted(SCALES)])
@pytest.mark.parametrize("name", TABLES)
def test_every_row_is_the_run_it_claims_to_be(name, scale, tmp_path):
    """...and validates (the unread-settings rule included), as make_table's preflight would refuse it: each
    row is composed once here for both checks (one seed's jobs: seeds differ only by `seed=`)."""
    plan = make_plan(load_spec(name), scale=SCALES[scale][0], smoke=SCALES[scale][1], runs_root=tmp_path)
    problems, n = [], 0
    for row in rows(plan):
        n += 1
        try:
            validate(row.cfg, machine=False)   # the values, not this machine (a full-scale row runs on GPUs)
            invalid = []
        except ConfigError as e:
            invalid = [f"does not validate: {e}"]
        wrong = invalid + not_held(row) + unmet(row, CLAIMS[name](row.values, scale))
        if wrong:
            problems.append(f"{' '.join(f'{k}={v}' for k, v in row.values.items())}: " + "; ".join(wrong))
    assert n == len(plan.jobs()) // len(plan.seeds)
    assert not problems, f"{len(problems)} rows of table {name} at {scale} scale are not what they claim:\n  " + \
        "\n  ".join(problems)
