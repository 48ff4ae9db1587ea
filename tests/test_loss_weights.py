"""P7 arithmetic: a step's weights are exact fractions that sum to one."""

from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from odb_core.loss import rank_weight, step_weights

counts = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 5000), st.integers(0, 300)), min_size=1, max_size=16)


@given(counts, st.sampled_from(["exact", "sample", "approx"]))
def test_weights_sum_to_exactly_one_when_the_step_has_a_denominator(rows, mode):
    samples = [n for n, _, _ in rows]
    tokens = [t for _, t, _ in rows]
    means = [Fraction(m, 7) for _, _, m in rows]
    weights = step_weights(mode, samples, tokens, means)
    basis = {"exact": tokens, "sample": samples, "approx": [n * m for n, m in zip(samples, means)]}[mode]
    assert sum(weights) == (1 if sum(basis) else 0)
    assert all(w == (Fraction(b) / sum(basis) if sum(basis) else 0) for w, b in zip(weights, basis))


@given(counts)
def test_exact_weight_is_tokens_over_step_tokens(rows):
    samples = [n for n, _, _ in rows]
    tokens = [t for _, t, _ in rows]
    for r in range(len(rows)):
        expected = Fraction(tokens[r], sum(tokens)) if sum(tokens) else 0
        assert rank_weight("exact", samples, tokens, [], r) == expected
