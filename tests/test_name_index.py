"""The registries' name index (grpo_lab/name_index.py): what validation asked is written out, a later reading
refuses the same unknown names with the same messages as the registries, and an index of other sources is
never trusted."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from grpo_lab import name_index
from grpo_lab.config import finalize, register_configs, validate
from grpo_lab.schema import ConfigError

register_configs()
CONF = Path(__file__).resolve().parents[1] / "conf"


def make(overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return finalize(compose("config", overrides=list(overrides)))


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    """An index written after validating the default config, as a launch writes it."""
    cache = tmp_path_factory.mktemp("cache")
    validate(make(), machine=False)
    name_index.write_index(cache)
    return cache


def full_refusals(overrides) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate(make(overrides), machine=False)
    return str(err.value).split("\n  - ")[1:]


def test_the_index_holds_each_checked_key_with_its_registrys_names(index_dir):
    from grpo_lab.algos import POLICY_LOSSES
    from grpo_lab.rewards import REWARDS

    index = json.loads((index_dir / name_index.INDEX_FILE).read_text())
    assert index["digest"] == name_index.source_digest()
    keys = index["keys"]
    assert keys["algorithm.policy_loss"] == {"kind": POLICY_LOSSES.kind, "form": "value",
                                             "names": sorted(POLICY_LOSSES.names())}
    assert keys["reward.weights"]["form"] == "keys" and keys["reward.weights"]["names"] == sorted(REWARDS.names())
    assert {"algorithm.objective", "rollout.engine", "model.builder", "task.source"} <= set(keys)


@pytest.mark.parametrize("overrides", [
    ["algorithm.policy_loss=clipped_surogate"],
    ["algorithm.advantage=grpp", "rollout.engine=vlm"],
    ["~reward.weights.correctness_binary", "+reward.weights.corectness=1.0"],
])
def test_an_unknown_name_is_refused_from_the_index_as_the_registry_refuses_it(index_dir, overrides):
    early = name_index.unknown_names(make(overrides), index_dir)
    assert early and set(early) <= set(full_refusals(overrides))


def test_registered_names_plug_in_paths_and_unset_keys_pass(index_dir):
    assert name_index.unknown_names(make(), index_dir) == []
    assert name_index.unknown_names(make(["algorithm.policy_loss=my_lab.losses:clip"]), index_dir) == []
    assert name_index.unknown_names(make(["interaction=none"]), index_dir) == []


def test_a_list_of_names_is_read_item_by_item(tmp_path):
    demos = ["interaction=verifier_feedback", "interaction.warmup_revision_frac=0.5"]
    validate(make([*demos, "interaction.warmup_demos_from=[verifier_feedback]"]), machine=False)
    name_index.write_index(tmp_path)
    assert name_index.unknown_names(make([*demos, "interaction.warmup_demos_from=[verifier_feedback]"]), tmp_path) == []
    two = [*demos, "interaction.warmup_demos_from=[verifier_feedback, hintz]"]
    refused = name_index.unknown_names(make(two), tmp_path)
    assert len(refused) == 1 and refused == [e for e in full_refusals(two) if "hintz" in e]


def test_an_index_of_other_sources_or_none_refuses_nothing(index_dir, tmp_path):
    bad = make(["algorithm.policy_loss=clipped_surogate"])
    assert name_index.unknown_names(bad, tmp_path) == []                       # no index here
    stale = json.loads((index_dir / name_index.INDEX_FILE).read_text())
    stale["digest"] = "0" * 16
    (tmp_path / name_index.INDEX_FILE).write_text(json.dumps(stale))
    assert name_index.unknown_names(bad, tmp_path) == []                       # the sources changed since
    (tmp_path / name_index.INDEX_FILE).write_text("{not json")
    assert name_index.unknown_names(bad, tmp_path) == []


def test_the_digest_follows_any_module_of_the_package(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text("x = 1\n")
    (package / "sub" / "b.py").write_text("y = 2\n")
    before = name_index.source_digest(package)
    assert name_index.source_digest(package) == before
    (package / "sub" / "b.py").write_text("y = 22\n")
    assert name_index.source_digest(package) != before
