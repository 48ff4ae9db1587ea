"""Every seeded bug in the core is caught by the hypothesis properties, and the
unmutated core violates none of them (the same checker, so it can tell them apart)."""

import pytest
from hypothesis import given

from model_checks.mutants import MUTANTS
from model_checks.mutation import BREAKS, EXTRA_HUNTS, hunt, violations
from model_checks.strategies import cases


def test_every_mutant_has_a_property_to_break():
    assert set(BREAKS) == set(MUTANTS) | set(EXTRA_HUNTS) and len(MUTANTS) >= 6


@pytest.mark.parametrize("mutant", [*MUTANTS, *EXTRA_HUNTS])
def test_hypothesis_catches_mutant(mutant):
    case = hunt(mutant)
    assert case is not None, f"mutant {mutant} survived the hypothesis hunt"


@given(cases())
def test_unmutated_core_violates_nothing(case):
    assert violations(case) == set()
