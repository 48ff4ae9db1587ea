"""ODBDataLoader's configuration surface (no process is started until iteration)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from torch_support import ToyDataset

from odb_core import ODBConfig
from odb_torch import ODBDataLoader


def test_config_model_is_accepted_as_is():
    config = ODBConfig(token_budget=64, buffer_size=8, mode="non-join", seed=5)
    loader = ODBDataLoader(ToyDataset(10), config=config, rank=0, world_size=1)
    assert loader.config == config and loader.sampler.seed == 5


def test_contradicting_or_missing_budget_is_an_error():
    with pytest.raises(ValueError, match="contradicts"):
        ODBDataLoader(ToyDataset(10), token_budget=32, config=ODBConfig(token_budget=64), rank=0, world_size=1)
    with pytest.raises(ValueError, match="needs token_budget"):
        ODBDataLoader(ToyDataset(10), rank=0, world_size=1)


def test_invalid_keyword_names_the_field():
    with pytest.raises(ValidationError, match="token_budget"):
        ODBDataLoader(ToyDataset(10), token_budget=0, rank=0, world_size=1)
    with pytest.raises(ValidationError, match="mode"):
        ODBDataLoader(ToyDataset(10), token_budget=64, mode="sometimes", rank=0, world_size=1)


@pytest.mark.parametrize(("keyword", "value"), [
    ("mode", "join"), ("buffer_size", 1024), ("target_policy", "balanced"), ("seed", 0),
    ("regroup_padding", None), ("shuffle_steps", True), ("loss_scaling", "exact"), ("depth", None),
    ("budget", "padded"),
])
def test_a_keyword_that_contradicts_config_is_refused_even_when_it_is_the_default(keyword, value):
    config = ODBConfig(token_budget=64, buffer_size=8, depth=9, mode="non-join", seed=5, loss_scaling="sample",
                       target_policy="paper", regroup_padding=0.1, shuffle_steps=False, budget="packed")
    with pytest.raises(ValueError, match=f"{keyword}={value!r} contradicts config.{keyword}"):
        ODBDataLoader(ToyDataset(10), config=config, rank=0, world_size=1, **{keyword: value})
    agreeing = {keyword: getattr(config, keyword)}
    assert ODBDataLoader(ToyDataset(10), config=config, rank=0, world_size=1, **agreeing).config == config


def test_keywords_left_out_take_the_configs_defaults():
    loader = ODBDataLoader(ToyDataset(10), token_budget=64, rank=0, world_size=1)
    assert loader.config == ODBConfig(token_budget=64)


@pytest.mark.parametrize(("budget", "policy"), [("padded", "balanced"), ("packed", "min")])
def test_target_policy_left_out_follows_the_budget_and_a_given_one_is_kept(budget, policy):
    """The default target: min under the packed budget (no split adds a part-full row), balanced
    under the padded one; a policy given explicitly is never replaced."""
    loader = ODBDataLoader(ToyDataset(10), token_budget=64, budget=budget, rank=0, world_size=1)
    assert loader.config.target_policy == policy == ODBConfig(token_budget=64, budget=budget).target_policy
    for given in ("paper", "all-ready", "balanced", "min"):
        assert ODBConfig(token_budget=64, budget=budget, target_policy=given).target_policy == given
    assert ODBConfig(**loader.config.model_dump()) == loader.config  # a dumped config round-trips
