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
    assert str(info.value).startswith(
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
    assert POLICY_LOSSES.names() == ["clipped_surrogate", "gspo", "gspo_token", "vanilla_pg", "cispo", "gmpo", "sapo",
                                     "dppo"]
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    assert AGGREGATIONS.names() == [
        "token_mean",
        "seq_mean_token_mean",
        "seq_mean_token_sum",
        "seq_mean_token_sum_norm",
    ]


def test_facts_live_on_entries_with_registry_defaults():
    reg = Registry("widget", defaults={"min_group_size": 1, "needs_critic": False})
    reg.register("pair", min_group_size=2)(lambda: 1)
    reg.register("plain")(lambda: 2)
    assert reg.fact("pair", "min_group_size") == 2 and reg.fact("plain", "min_group_size") == 1
    assert reg.fact("pair", "needs_critic") is False
    with pytest.raises(ValueError, match="unknown facts"):
        reg.register("typo", min_grup_size=2)
    assert ADVANTAGE_ESTIMATORS.fact("rloo", "min_group_size") == 2
    assert ADVANTAGE_ESTIMATORS.fact("gae", "needs_critic") is True


def test_call_passes_each_function_only_the_settings_it_names():
    reg = Registry("widget")
    reg.register("a")(lambda x, *, scale: x * scale)
    reg.register("b")(lambda x: -x)
    reg.register("c")(lambda x, **kw: sorted(kw))
    settings = {"scale": 3, "name": "ignored", "unused": 1}
    assert reg.call("a", 2, **settings) == 6
    assert reg.call("b", 2, **settings) == -2
    assert reg.call("c", 0, **settings) == ["name", "scale", "unused"]   # **kwargs takes everything


def test_bind_resolves_once_what_call_does_each_time():
    reg = Registry("widget")
    reg.register("a")(lambda x, *, scale: x * scale)
    reg.register("b")(lambda x: -x)
    settings = {"scale": 3, "unused": 1}
    bound_a, bound_b = reg.bind("a", **settings), reg.bind("b", **settings)
    assert bound_a.keywords == {"scale": 3} and bound_b.keywords == {}   # only what each signature names
    assert bound_a(2) == reg.call("a", 2, **settings) == 6
    assert bound_b(2) == reg.call("b", 2, **settings) == -2
    with pytest.raises(UnknownChoiceError, match="valid choices: a, b"):
        reg.bind("nope", **settings)


def test_plug_ins_by_import_path():
    reg = Registry("widget", defaults={"min_group_size": 1})
    assert "os.path:join" in reg and reg.get("os.path:join")("a", "b") == "a/b"
    assert reg.get("os.path.join") is reg.get("os.path:join")          # both spellings
    assert reg.fact("os.path:join", "min_group_size") == 1
    assert "no_such_module_xyz:f" not in reg
    with pytest.raises(UnknownChoiceError, match="cannot import module .no_such_module_xyz. .ModuleNotFoundError"):
        reg.get("no_such_module_xyz:f")
    with pytest.raises(UnknownChoiceError, match="not a callable"):
        reg.get("os:sep")
