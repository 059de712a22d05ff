"""Registry behaviour and the exact names each algos registry exposes (configs depend on them)."""

import pytest

from grpo_lab.algos import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from grpo_lab.registry import Registry, UnknownChoiceError


def test_register_get_names_contains():
    reg = Registry("widget")

    @reg.register("a")
    def a():
        return 1

    @reg.register("b")
    def b():
        return 2

    assert reg.get("a") is a and reg.get("b")() == 2
    assert reg.names() == ["a", "b"]  # registration order
    assert "a" in reg and "c" not in reg and ["unhashable"] not in reg
    assert len(reg) == 2 and list(reg) == ["a", "b"]


def test_duplicate_name_is_an_error():
    reg = Registry("widget")
    reg.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.register("a")(lambda: 2)


def test_unknown_name_lists_valid_choices_and_is_keyerror_and_valueerror():
    with pytest.raises(KeyError) as info:
        ADVANTAGE_ESTIMATORS.get("grpp")
    assert str(info.value) == (
        "unknown advantage estimator 'grpp'; valid choices: "
        "group_zscore, group_mean, group_mean_batch_std, rloo, reinforce_pp, gae"
    )
    assert isinstance(info.value, ValueError) and isinstance(info.value, UnknownChoiceError)
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'; valid choices: clipped_surrogate"):
        POLICY_LOSSES.get("ppo")


def test_registry_contents():
    assert ADVANTAGE_ESTIMATORS.names() == [
        "group_zscore",
        "group_mean",
        "group_mean_batch_std",
        "rloo",
        "reinforce_pp",
        "gae",
    ]
    assert POLICY_LOSSES.names() == ["clipped_surrogate", "gspo", "gspo_token", "vanilla_pg"]
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    assert AGGREGATIONS.names() == [
        "token_mean",
        "seq_mean_token_mean",
        "seq_mean_token_sum",
        "seq_mean_token_sum_norm",
    ]
