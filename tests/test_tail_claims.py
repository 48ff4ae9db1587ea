"""The shared tail's claim rule (odb_core.tail): a pure function of the gathered headers that
never hands out more than the pool holds, only to ranks with nothing pending, at most the cap
each, always at least one view while such a rank exists (the pool drains, P6), and the least
loaded first (the ranks end with about equal work)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from odb_core.sampler import epoch_views, tail_views
from odb_core.tail import tail_claims

ranks = st.integers(1, 12)


@given(st.data())
def test_claims_respect_the_pool_the_cap_and_pending(data):
    w = data.draw(ranks)
    pending = data.draw(st.lists(st.sampled_from([0, 0, 1, 5, 300]), min_size=w, max_size=w))
    samples = data.draw(st.lists(st.integers(0, 50), min_size=w, max_size=w))
    load = [s * data.draw(st.integers(0, 900)) for s in samples]
    left, cap = data.draw(st.integers(0, 400)), data.draw(st.integers(1, 64))
    claims = tail_claims(pending, load, samples, left, cap)
    assert len(claims) == w and sum(claims) <= left
    assert all(c == 0 for c, p in zip(claims, pending) if p), "a rank with views pending claims nothing"
    assert all(0 <= c <= cap for c in claims)
    if left and any(p == 0 for p in pending):
        assert sum(claims) >= 1, "the pool must drain while a rank has nothing pending"
    assert claims == tail_claims(list(pending), list(load), list(samples), left, cap), "P8"


def test_the_light_rank_takes_the_pool_up_to_the_level():
    # rank 1 holds far less work; the level fills it first, rank 0 (heavier) gets the rest
    claims = tail_claims(pending=[0, 0], load=[9000, 1000], samples=[10, 10], left=10, cap=100)
    assert claims[1] > claims[0] and sum(claims) == 10
    # a seeded bug's symptom: handing out by rank order alone would give rank 0 everything
    assert claims != [10, 0]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300), st.integers(1, 9), st.floats(0, 0.99))
def test_the_pool_and_the_own_shards_cover_the_order_and_count_as_epoch_views(n, world, fraction):
    """P4 at the split: every view of the order is in the pool or in some rank's shard, the pool
    the same on every rank, and epoch_views counts what an epoch serves (windows' LR totals)."""
    order = list(range(n))
    shares = [tail_views(order, world, r, fraction) for r in range(world)]
    assert len({tuple(pool) for _, pool in shares}) == 1
    pool = shares[0][1]
    assert len(pool) == int(n * fraction)
    assert set(pool).union(*(set(own) for own, _ in shares)) == set(order)
    assert not set(pool) & set().union(*(set(own) for own, _ in shares))
    assert sum(len(own) for own, _ in shares) + len(pool) == epoch_views(n, world, fraction)
