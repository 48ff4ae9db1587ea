"""One rank's state machine driven by hypothesis against scripted peers.

Peers send arbitrary well-formed headers and step vectors (and, sometimes, corrupted
ones first). Invariants after every call: P1 partition, |Q| + |B| <= D, the target
equals the policy's value on the gathered headers, emitted items number exactly T
(P2), groups respect the budget, padded or packed (P3), step weights sum to one (P7).
"""

from fractions import Fraction

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from odb_core import Header, ODBConfig, PeerInconsistencyError, Phase, RankProtocol, Status, WireFormatError
from odb_core.alignment import TARGET_FUNCTIONS
from odb_core.budgets import within_budget
from odb_core.config import TARGET_POLICIES
from odb_core.wire import decode_header


class OneRankVsPeers(RuleBasedStateMachine):
    @initialize(
        world=st.integers(1, 5),
        n=st.integers(0, 40),
        budget=st.sampled_from([1, 10, 100, 1000]),
        buffer_size=st.integers(1, 8),
        extra_depth=st.integers(0, 4),
        mode=st.sampled_from(["join", "non-join"]),
        policy=st.sampled_from(TARGET_POLICIES),
        overflow=st.sampled_from(["largest", "oldest"]),
        capacity=st.one_of(st.none(), st.integers(1, 4)),
        scaling=st.sampled_from(["none", "sample", "approx", "exact"]),
        regroup=st.sampled_from([None, 0.0, 0.02, 0.3]),
        kind=st.sampled_from(["padded", "packed"]),
        data=st.data(),
    )
    def setup(self, world, n, budget, buffer_size, extra_depth, mode, policy, overflow, capacity, scaling, regroup,
              kind, data):
        self.cfg = ODBConfig(
            token_budget=budget, budget=kind, buffer_size=buffer_size, depth=buffer_size + extra_depth, mode=mode,
            target_policy=policy, overflow_policy=overflow, output_capacity=capacity, loss_scaling=scaling,
            regroup_padding=regroup,
        )
        self.rank = data.draw(st.integers(0, world - 1))
        self.world = world
        self.p = RankProtocol(self.cfg, self.rank, world, list(range(1000, 1000 + n)))
        self.pipeline: list[int] = []

    def is_open(self):
        return self.p.phase is Phase.OPEN

    @precondition(is_open)
    @rule()
    def fetch(self):
        self.pipeline.extend(self.p.fetch())

    @precondition(lambda self: self.is_open() and self.pipeline)
    @rule(data=st.data())
    def arrive(self, data):
        chosen = data.draw(st.lists(st.sampled_from(self.pipeline), min_size=1, unique=True))
        for pos in chosen:
            length = data.draw(st.integers(0, 3 * self.cfg.token_budget))
            self.p.arrive(pos, length, data.draw(st.integers(0, length)))
            self.pipeline.remove(pos)

    def peer_header(self, data, it, rnd):
        kind = data.draw(st.integers(0, 9))
        if kind == 0:
            return Header(it, rnd, Status.FINISHED, 0, 0, 0, 0)
        samples = data.draw(st.integers(1, 30))
        cap = data.draw(st.sampled_from([0, 0, 1, 3, 50]))
        if kind <= 3:
            return Header(it, rnd, Status.WAITING, 0, cap, samples, data.draw(st.integers(0, 999)))
        return Header(it, rnd, Status.READY, data.draw(st.integers(1, samples)), cap, samples, data.draw(st.integers(0, 999)))

    @precondition(is_open)
    @rule(data=st.data(), corrupt=st.booleans())
    def round(self, data, corrupt):
        own = self.p.begin_round()
        mine = decode_header(own, self.rank)
        headers = [mine if r == self.rank else self.peer_header(data, mine.iteration, mine.round) for r in range(self.world)]
        gathered = [h.encode() for h in headers]
        if corrupt:
            bad = [list(v) for v in gathered]
            victim = data.draw(st.integers(0, self.world - 1))
            how = data.draw(st.sampled_from(["round", "status", "negative", "short", "missing"]))
            if how == "round":
                bad[victim][1] += 1
            elif how == "status":
                bad[victim][2] = 9
            elif how == "negative":
                bad[victim][data.draw(st.integers(0, 6))] = -1
            elif how == "short":
                bad[victim].pop()
            else:
                bad.pop(victim)
            try:
                self.p.on_headers(bad)
                raise AssertionError(f"corrupted gather ({how}) was accepted")
            except (WireFormatError, PeerInconsistencyError):
                pass
            assert self.p.phase is Phase.HEADER_SENT  # a rejected gather changes nothing
        plan = self.p.on_headers(gathered)
        statuses = [h.status for h in headers]
        done = (all if self.cfg.mode == "join" else any)(s is Status.FINISHED for s in statuses)
        assert plan.done == done
        if done:
            assert self.p.phase is Phase.DONE
            return
        target = TARGET_FUNCTIONS[self.cfg.target_policy](headers)
        assert plan.target == target
        if not target:
            assert plan.step_vector is None
            return
        vectors = []
        for r, h in enumerate(headers):
            if r == self.rank:
                vectors.append(plan.step_vector)
            elif h.status is Status.READY:
                sizes = [1] * target
                for _ in range(data.draw(st.integers(0, h.samples - target))):
                    sizes[data.draw(st.integers(0, target - 1))] += 1
                left, tokens = h.tokens, []  # a peer emits no more loss tokens than it held
                for _ in sizes:
                    tokens.append(data.draw(st.integers(0, min(50, left))))
                    left -= tokens[-1]
                vectors.append([v for n, t in zip(sizes, tokens) for v in (n, t)])
            else:
                vectors.append([0] * (2 * target))
        before = len(self.p.emitted)
        steps = self.p.on_steps(vectors)
        assert len(steps) == target  # P2: exactly T items on this rank
        assert all(s.is_idle for s in steps) == (mine.status is not Status.READY)
        assert len(self.p.emitted) - before == sum(s.local_samples for s in steps)
        for i, s in enumerate(steps):
            assert within_budget(self.cfg.budget, s.lengths, self.cfg.token_budget)  # P3
            total_tokens = sum(vectors[r][2 * i + 1] for r in range(self.world))
            assert s.global_tokens == total_tokens
            if self.cfg.loss_scaling == "exact":
                assert s.weight == (Fraction(s.local_tokens, total_tokens) if total_tokens else 0)  # P7

    @precondition(lambda self: self.p.phase is Phase.DONE)
    @rule()
    def next_iteration(self):
        """Chain the next logical iteration over the same views (as non-join chaining does)."""
        self.p = RankProtocol(self.cfg, self.rank, self.world, self.p.views, self.p.iteration + 1)
        self.pipeline = []

    @invariant()
    def p1_partition_and_depth(self):
        p = self.p
        r, q, b, e = p.remaining, p.in_flight, set(p.buffered), p.emitted
        assert len(r) + len(q) + len(b) + len(e) == len(p.views)
        assert set(r) | q | b | set(e) == set(range(len(p.views)))
        h = p.held  # regroup: held samples stay in B and count toward neither the buffer nor D
        d = self.cfg.outstanding_depth
        assert h <= b and len(h) <= d
        # the true bound (tests/test_depth_bound.py, spec DepthBound): |Q| + |B \ H| <= D is false once a
        # round releases held samples that stay in B (this machine found it: Q 3, B 9, H 0, D 11)
        assert len(q) + len(b) <= (d if self.cfg.regroup_padding is None else 2 * d)
        assert q == set(self.pipeline)


TestOneRankVsPeers = OneRankVsPeers.TestCase
