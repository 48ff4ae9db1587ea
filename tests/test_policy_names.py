"""One list of policy and mode names (``odb_core.config``): the core's target functions, the
``odb`` CLI, the conformance scenarios, the spec's constants and its TLC configurations
all spell the same names, and every target policy is model-checked somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from model_checks.conformance import SHUFFLED_SCENARIOS, STATE_SPACE_SCENARIOS
from odb_core.alignment import TARGET_FUNCTIONS
from odb_core.config import MODES, OVERFLOW_POLICIES, TARGET_POLICIES
from odb_tools.cli import build_parser

SPEC = Path(__file__).resolve().parents[1] / "spec"


def _spec_set(constant: str) -> set[str]:
    """The string set the spec's ASSUME allows for ``constant`` (``Policy \\in {...}``)."""
    text = (SPEC / "ODB.tla").read_text()
    found = re.search(constant + r' \\in \{([^}]*)\}', text)
    assert found, f"ODB.tla has no ASSUME for {constant}"
    return set(re.findall(r'"([^"]+)"', found.group(1)))


def _cfg_values(constant: str) -> set[str]:
    return {m for cfg in (SPEC / "cfg").glob("*.cfg")
            for m in re.findall(rf'^\s*{constant} = "([^"]+)"', cfg.read_text(), re.M)}


def test_core_target_functions_are_the_listed_policies():
    assert tuple(TARGET_FUNCTIONS) == TARGET_POLICIES


def test_spec_constants_allow_exactly_the_listed_names():
    assert _spec_set("Policy") == set(TARGET_POLICIES)
    assert _spec_set("Overflow") == set(OVERFLOW_POLICIES)


def test_every_target_policy_is_model_checked_and_no_config_names_another():
    assert _cfg_values("Policy") == set(TARGET_POLICIES)
    assert _cfg_values("Overflow") == set(OVERFLOW_POLICIES)
    scenarios = STATE_SPACE_SCENARIOS + SHUFFLED_SCENARIOS
    assert {s.policy for s in scenarios} <= set(TARGET_POLICIES)
    assert {s.overflow for s in scenarios} <= set(OVERFLOW_POLICIES)


@pytest.mark.parametrize(("flag", "names"), [("--target-policy", TARGET_POLICIES),
                                             ("--overflow-policy", OVERFLOW_POLICIES), ("--mode", MODES)])
def test_cli_offers_exactly_the_listed_names(flag, names):
    simulate = build_parser()._subparsers._group_actions[0].choices["simulate"]  # type: ignore[union-attr]
    action = next(a for a in simulate._actions if flag in a.option_strings)
    assert tuple(action.choices) == names
