-------------------------------- MODULE ODB --------------------------------
(***************************************************************************)
(* Online Dynamic Batching: the per-rank R/Q/B/E protocol of odb_core,     *)
(* with W ranks, per-rank fetch and drain bounded by the outstanding depth *)
(* D, and one atomic gather/align/emit step for all ranks.                  *)
(*                                                                         *)
(* Ranks are 1..W and a rank's views are positions 1..NV[r] (odb_core uses *)
(* 0-based ones); Length[r][p] is the realized length of view p on rank r. *)
(* R is the suffix next[r]..NV[r] of the sampler order, Q a set, B a       *)
(* sequence in arrival order (arrival order breaks overflow ties), E a set.*)
(* The grouping, the target policy and the alignment are operators, so a   *)
(* .cfg can substitute alternatives and seeded bugs (mutants).             *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, TLC

CONSTANTS W,          \* number of ranks
          NV,         \* <<n_1, ..., n_W>>: views per rank
          Length,     \* <<<<l_1_1, ...>>, ...>>: Length[r][p]
          Budget,     \* L_max
          BudgetKind, \* "padded": max length x size <= L_max (B(l) walk); "packed": sum of sizes <= L_max
          BufSize,    \* buffer_size
          Depth,      \* outstanding depth D
          Capacity,   \* output slots per rank per round; 0 = unbounded
          JoinMode,   \* TRUE: join; FALSE: non-join with quota chaining
          Quota,      \* non-join sample quota N
          Overflow,   \* "largest" (paper) or "oldest"
          Policy,     \* target policy: "paper" (Eq. 3), "all-ready", "balanced" or "min"
          RegroupNum, \* regroup: hold back groups with padding > RegroupNum / RegroupDen
          RegroupDen  \* (0 = off; odb_core's regroup_padding)

ASSUME W \in Nat \ {0} /\ Len(NV) = W /\ Budget \in Nat \ {0} /\ BudgetKind \in {"padded", "packed"}
ASSUME BufSize \in Nat \ {0} /\ Depth \in Nat /\ Capacity \in Nat /\ Quota \in Nat
ASSUME RegroupNum \in Nat /\ RegroupDen \in Nat
ASSUME JoinMode \in BOOLEAN /\ Overflow \in {"largest", "oldest"} /\ Policy \in {"paper", "all-ready", "balanced", "min"}

VARIABLES next,     \* R = next[r]..NV[r]
          Q,        \* in flight: set of positions
          B,        \* buffer, arrival order, overflow included
          E,        \* emitted positions (this logical iteration)
          H,        \* held back at the rank's last emitting round to regroup (a subset of B)
          consumed, \* non-join: global samples consumed by the trainer
          lastStep, \* non-join: global samples of the last consumed step
          lastOut,  \* items each rank emitted in the last gather (<<>> = idle item)
          rounds,   \* emitting rounds in this logical iteration
          done,     \* the epoch is over
          pc,       \* the shared tail: pool views claimed so far (by every rank)
          claimed   \* claimed[r]: the pool indices rank r claimed, in order (its views NV[r] + 1, ...)

vars == <<next, Q, B, E, H, consumed, lastStep, lastOut, rounds, done, pc, claimed>>
Ranks == 1..W

---------------------------------------------------------------------------
Max(S) == CHOOSE m \in S : \A x \in S : x <= m
Min(S) == CHOOSE m \in S : \A x \in S : m <= x
Range(s) == {s[i] : i \in DOMAIN s}
Reverse(s) == [i \in 1..Len(s) |-> s[Len(s) - i + 1]]
RECURSIVE SumSeq(_)
SumSeq(s) == IF s = <<>> THEN 0 ELSE Head(s) + SumSeq(Tail(s))
(* The shared tail (odb_core.tail): Pool holds the lengths of the views   *)
(* kept out of the shards (<<>>: none; a .cfg substitutes Pool <- ...). A  *)
(* rank's views are its shard's 1..NV[r], then the pool views it claimed.  *)
Pool == <<>>
ClaimCap == BufSize
\* odb_core ODBConfig.reserve_divisor: a reserve round deals to ceil(W / ReserveDiv) ranks (a .cfg
\* substitutes ReserveDiv <- ...; with 8 and W <= 8, one rank a round)
ReserveDiv == 8
NVr(r) == NV[r] + Len(claimed[r])
LenOf(r, p) == IF p <= NV[r] THEN Length[r][p] ELSE Pool[claimed[r][p - NV[r]]]
Views(r) == 1..NVr(r)
Remaining(r) == next[r]..NVr(r)
Pend(r) == Cardinality(Remaining(r)) + Cardinality(Q[r])  \* views not yet arrived

(* Streams (an IterableDataset): a rank's view count is unknown until its  *)
(* stream ends. NV[r] is then the stream's length, which the rank does not *)
(* know: Fetch takes positions up to the depth with no upper bound, and a   *)
(* fetch that reaches past NV[r] reveals the end (the read of position     *)
(* NV[r] + 1 finds the stream exhausted: odb_core's end_stream); next[r] =  *)
(* NV[r] + 2 records that the end is known. Only then can the rank drain   *)
(* and finish (P4). A .cfg turns streams on with StreamOn <- StreamsOn;    *)
(* every length a configuration gives (uneven, empty) is one the rank      *)
(* discovers only by fetching past it.                                     *)
StreamOn == FALSE
StreamsOn == TRUE
EndKnown(r) == (~StreamOn \/ next[r] > NV[r] + 1) /\ pc = Len(Pool)
\* the positions a fetch up to `last` puts in Q: those before the end (a .cfg may seed a bug here)
StreamFetched(r, last) == next[r]..(IF StreamOn /\ last > NV[r] THEN NV[r] ELSE last)

\* B(l) = max(floor(L_max / l), 1); zero lengths count as 1.
BS(l) == LET q == Budget \div (IF l < 1 THEN 1 ELSE l) IN IF q < 1 THEN 1 ELSE q

---------------------------------------------------------------------------
(* Per-rank status, as the header reports it.                              *)
Drained(r) == EndKnown(r) /\ next[r] > NVr(r) /\ Q[r] = {}
IsFinished(r) == Drained(r) /\ B[r] = <<>>
\* "idle": the shared tail's pool is open and the rank holds nothing (R, Q, B empty): it claims
\* at this gather, emits idle items, and blocks no target policy (it is neither ready nor waiting)
\* PoolDry(r): the pool is open and every view of r has arrived: r groups what it has (ready)
\* rather than wait for claims, so its samples wait no longer than without a pool
PoolDry(r) == pc < Len(Pool) /\ Pend(r) = 0
Status(r) == IF IsFinished(r) THEN "finished"
             ELSE IF B[r] = <<>> /\ PoolDry(r) THEN "idle"
             ELSE IF B[r] # <<>> /\ (Len(B[r]) - Cardinality(H[r]) >= BufSize \/ Drained(r) \/ PoolDry(r)) THEN "ready"
             ELSE "waiting"

(* Grouping: the B(l) walk over B sorted by (length, position).            *)
(* Values are bound with CHOOSE w \in {e(x) : x \in {v}} : TRUE, not LET:  *)
(* when TLC checks fairness it re-evaluates LET values and lazy operator   *)
(* arguments on every reference, which made the walk exponential in the   *)
(* number of groups (a buffer of 8 stalled Termination for minutes).       *)
ShorterFirst(r, a, b) == LenOf(r, a) < LenOf(r, b) \/ (LenOf(r, a) = LenOf(r, b) /\ a < b)
RECURSIVE Walk(_, _, _, _)
Walk(r, order, end, t) ==
    IF end = 0 THEN <<>>
    ELSE CHOOSE w \in {<<SubSeq(order, start + 1, end)>> \o Walk(r, order, start, BS(LenOf(r, order[start + 1])))
                       : start \in {IF end > t THEN end - t ELSE 0}} : TRUE
BRule(r) == CHOOSE w \in {Reverse(Walk(r, order, Len(order), 1))
                          : order \in {SortSeq(B[r], LAMBDA a, b : ShorterFirst(r, a, b))}} : TRUE

(* The packed budget (odb_core.packing): a group costs the sum of its      *)
(* sizes, a zero length sized 1. Best-fit decreasing over B sorted by      *)
(* (length, position), the samples held back at the last round (H) walked *)
(* first, then the others, each part from the longest: each sample goes    *)
(* into the fullest group it fits in (ties: the group opened first), else  *)
(* it opens a group. Groups are laid out short to long by their longest    *)
(* sample, each group's positions short to long, as pack_buffer returns    *)
(* them. A sample longer than Budget opens a group nothing else fits in:   *)
(* it travels alone.                                                       *)
(* FitOp is an operator so a .cfg can substitute a seeded bug.             *)
Size(l) == IF l < 1 THEN 1 ELSE l
Load(r, g) == SumSeq([k \in DOMAIN g |-> Size(LenOf(r, g[k]))])
\* the groups (by index into loads, the groups' sums of sizes) a sample of size s fits in
Fits(loads, s) == {i \in DOMAIN loads : loads[i] + s <= Budget}
FitOp(loads, s) == Fits(loads, s)
\* the fullest group the sample fits in (ties: the first opened); 0: none, open a group
BestFit(loads, s) ==
    CHOOSE w \in {IF fit = {} THEN 0
                  ELSE CHOOSE i \in fit : \A j \in fit : loads[j] < loads[i] \/ (loads[j] = loads[i] /\ i <= j)
                  : fit \in {FitOp(loads, s)}} : TRUE
Place(bins, i, p) == IF i = 0 THEN Append(bins, <<p>>) ELSE [bins EXCEPT ![i] = Append(@, p)]
AddLoad(loads, i, s) == IF i = 0 THEN Append(loads, s) ELSE [loads EXCEPT ![i] = @ + s]
RECURSIVE PackWalk(_, _, _, _)
PackWalk(r, order, bins, loads) ==
    IF order = <<>> THEN bins
    ELSE CHOOSE w \in {CHOOSE v \in {PackWalk(r, Tail(order), Place(bins, i, Head(order)), AddLoad(loads, i, s))
                                    : i \in {BestFit(loads, s)}} : TRUE
                       : s \in {Size(LenOf(r, Head(order)))}} : TRUE
\* the walk's order: H[r]'s positions longest first, then the other buffered ones longest first
PackOrder(r) ==
    CHOOSE w \in {Reverse(SelectSeq(asc, LAMBDA p : p \in H[r])) \o Reverse(SelectSeq(asc, LAMBDA p : p \notin H[r]))
                  : asc \in {SortSeq(B[r], LAMBDA a, b : ShorterFirst(r, a, b))}} : TRUE
\* the layout: each group short to long, the groups by their longest position (short to long)
Layout(r, bs) ==
    SortSeq([k \in DOMAIN bs |-> SortSeq(bs[k], LAMBDA a, b : ShorterFirst(r, a, b))],
            LAMBDA g, h : ShorterFirst(r, g[Len(g)], h[Len(h)]))
PackRule(r) == Layout(r, PackWalk(r, PackOrder(r), <<>>, <<>>))

\* The grouping of a ready rank's buffer under the budget.
Packing(r) == IF BudgetKind = "packed" THEN PackRule(r) ELSE BRule(r)

(* P3 per budget: a group of >= 2 samples costs at most Budget: max length *)
(* x size (padded) or the sum of its sizes (packed); a lone sample may be  *)
(* longer than Budget (it travels alone).                                  *)
MaxLen(r, g) == Max({LenOf(r, p) : p \in Range(g)})
GroupCost(r, g) == IF BudgetKind = "packed" THEN Load(r, g) ELSE MaxLen(r, g) * Len(g)
WithinBudget(r, g) == Len(g) >= 2 => GroupCost(r, g) <= Budget

(* A packing of rank r's buffer is admissible if it partitions B[r] into   *)
(* non-empty groups and every group is within the budget (WithinBudget).   *)
(* BRuleAdmissible checks the budget's rule (Packing) is one such packing. *)
Admissible(r, gs) ==
    /\ \A k \in DOMAIN gs : Len(gs[k]) >= 1 /\ WithinBudget(r, gs[k])
    /\ SumSeq([k \in DOMAIN gs |-> Len(gs[k])]) = Len(B[r])
    /\ UNION {Range(g) : g \in Range(gs)} = Range(B[r])

(* Regroup (odb_core's regroup_padding, grouping.hold_sparse). A rank that *)
(* is not drained may hold back a group of >= 2 samples, none of them held *)
(* at its last round (H), whose padding exceeds RegroupNum / RegroupDen    *)
(* (Holdable; padding of the area max length x size, or, packed, of       *)
(* Budget: the budget the group leaves unused): held groups stay in B and  *)
(* regroup with the next arrivals,                                         *)
(* where lengths are denser. It holds the holdable groups in walk order    *)
(* while their cumulative size stays <= Depth (a prefix: the first one     *)
(* that does not fit ends it, later ones are kept), so |H| <= D. If every  *)
(* group would be held, none is. Held samples do not count toward the      *)
(* buffer or the depth until the next emitting round (so a hold never      *)
(* shrinks the next buffer), and a rank with fewer kept groups than T      *)
(* emits held groups (in walk order) before it splits any.                 *)
SumLen(r, g) == SumSeq([k \in DOMAIN g |-> LenOf(r, g[k])])
Area(r, g) == IF BudgetKind = "packed" THEN Budget ELSE MaxLen(r, g) * Len(g)
Sparse(r, g) == LET area == Area(r, g) IN (area - SumLen(r, g)) * RegroupDen > RegroupNum * area
(* The packed budget's pool hold (grouping.hold_sparse with pool): while *)
(* the pool is open and every view of the rank has arrived (PoolDry), it   *)
(* keeps its part-full groups open for the pool views it claims: a group   *)
(* of one sample is holdable too, H does not exempt (a group is held      *)
(* again), and every group may be held; the rank then waits (HeldStatus). *)
(* The pool drains (Claims), so no group is held for ever.                 *)
PoolHold(r) == BudgetKind = "packed" /\ RegroupDen > 0 /\ PoolDry(r)
Holdable(r, g) == RegroupDen > 0 /\ ~Drained(r) /\ Sparse(r, g)
                  /\ IF PoolHold(r) THEN Len(g) >= 1 ELSE Len(g) >= 2 /\ Range(g) \cap H[r] = {}
\* the holdable groups in walk order, cut at cumulative size Depth (a prefix: sizes are positive)
CapHeld(gs, hd) == {i \in hd : SumSeq([k \in 1..i |-> IF k \in hd THEN Len(gs[k]) ELSE 0]) <= Depth}
HoldIdx(r, gs) ==
    CHOOSE h \in {IF c = DOMAIN gs /\ ~PoolHold(r) THEN {} ELSE c
                  : c \in {CapHeld(gs, hd) : hd \in {{i \in DOMAIN gs : Holdable(r, gs[i])}}}} : TRUE
\* the statuses the header reports: a ready rank holding every group (a pool hold) waits
HeldStatus(st, gs, hs) ==
    [r \in Ranks |-> IF st[r] = "ready" /\ gs[r] # <<>> /\ hs[r] = DOMAIN gs[r] THEN "waiting" ELSE st[r]]
\* the header's room: the budget a held group leaves unused, the most over a pool-holding rank's
RoomOf(gs, hs) ==
    [r \in Ranks |-> IF PoolHold(r) /\ hs[r] # {} THEN Max({Budget - SumLen(r, gs[r][i]) : i \in hs[r]}) ELSE 0]
Pick(gs, idx) == LET ks == SelectSeq([i \in 1..Len(gs) |-> i], LAMBDA i : i \in idx) IN [k \in 1..Len(ks) |-> gs[ks[k]]]
\* the held indices still held once a rank with fewer than T kept groups took back what it needs
StillHeld(gs, h, T) ==
    LET hs == SelectSeq([i \in 1..Len(gs) |-> i], LAMBDA i : i \in h)
        need == T - (Len(gs) - Cardinality(h))
    IN IF need <= 0 THEN h ELSE IF need >= Len(hs) THEN {} ELSE Range(SubSeq(hs, need + 1, Len(hs)))

(* Target policies over the gathered statuses, group and sample counts.    *)
Active(st) == {r \in Ranks : st[r] = "ready"}
\* the bounds of Eq. 3 on an aim: max(min(aim, C_min+, S_min+), 1) over the active ranks
Bounded(st, S, aim) ==
    LET m == Min({aim} \cup (IF Capacity > 0 THEN {Capacity} ELSE {}) \cup {S[r] : r \in Active(st)})
    IN IF m < 1 THEN 1 ELSE m
Waiting(st) == \E r \in Ranks : st[r] = "waiting"
PaperTarget(st, G, S) ==
    IF Active(st) = {} THEN 0 ELSE Bounded(st, S, Max({G[r] : r \in Active(st)}))
AllReadyTarget(st, G, S) ==
    IF Waiting(st) THEN 0 ELSE PaperTarget(st, G, S)
RECURSIVE SumOver(_, _)
SumOver(f, S) == IF S = {} THEN 0 ELSE LET x == CHOOSE y \in S : TRUE IN f[x] + SumOver(f, S \ {x})
\* "balanced": all-ready, aiming at ceil(mean G) over active ranks instead of max G;
\* ranks above the target overflow their surplus groups (the same Overflow as capacity)
BalancedTarget(st, G, S) ==
    IF Waiting(st) \/ Active(st) = {} THEN 0
    ELSE LET n == Cardinality(Active(st)) IN Bounded(st, S, (SumOver(G, Active(st)) + n - 1) \div n)
\* "min": all-ready, aiming at min G over active ranks: T <= every active rank's G, so no
\* rank splits to reach it; ranks above it overflow their surplus groups
MinTarget(st, G, S) ==
    IF Waiting(st) \/ Active(st) = {} THEN 0 ELSE Bounded(st, S, Min({G[r] : r \in Active(st)}))
Target(st, G, S) ==
    CASE Policy = "all-ready" -> AllReadyTarget(st, G, S)
      [] Policy = "balanced" -> BalancedTarget(st, G, S)
      [] Policy = "min" -> MinTarget(st, G, S)
      [] OTHER -> PaperTarget(st, G, S)

(* Alignment: split (Alg. 1, upward) and overflow (downward).              *)
RECURSIVE SplitTo(_, _)
SplitTo(gs, T) ==
    IF Len(gs) >= T THEN gs
    ELSE LET big == {i \in 1..Len(gs) : Len(gs[i]) >= 2}
         IN IF big = {} THEN gs
            ELSE LET i == Max(big)
                     g == gs[i]
                 IN SplitTo(SubSeq(gs, 1, i - 1) \o <<SubSeq(g, 1, Len(g) - 1), <<g[Len(g)]>>>>
                            \o SubSeq(gs, i + 1, Len(gs)), T)
Age(r, g) == Min({i \in DOMAIN B[r] : B[r][i] \in Range(g)})
Before(r, gs, a, b) ==
    IF Overflow = "largest"
    THEN Len(gs[a]) > Len(gs[b]) \/ (Len(gs[a]) = Len(gs[b]) /\ Age(r, gs[a]) < Age(r, gs[b]))
    ELSE Age(r, gs[a]) < Age(r, gs[b])
KeepTop(r, gs, T) ==
    LET ranked == SortSeq([i \in 1..Len(gs) |-> i], LAMBDA a, b : Before(r, gs, a, b))
        keep == Range(SubSeq(ranked, 1, T))
        idx == SelectSeq([i \in 1..Len(gs) |-> i], LAMBDA i : i \in keep)
    IN [k \in 1..Len(idx) |-> gs[idx[k]]]
Align(r, gs, T) ==
    IF Len(gs) < T THEN SplitTo(gs, T)
    ELSE IF Len(gs) > T THEN KeepTop(r, gs, T)
    ELSE gs
AlignOp(r, gs, T) == Align(r, gs, T)

(* Emission order. Each rank emits its T aligned items in an order of its *)
(* own: odb_core shuffles them with a seeded per-rank permutation          *)
(* (ODBConfig.shuffle_steps), before the step vectors are gathered, so the *)
(* k-th items of all ranks form step k. The spec admits every order        *)
(* (AnyOrder); InOrder (the aligned order, shuffle_steps off) is one of    *)
(* them. Only the non-join quota (which steps are consumed) depends on the *)
(* order: in join mode it reaches nothing but lastOut, whose properties    *)
(* (Lockstep, BudgetOK, WithinCapacity) hold for every order iff for one,  *)
(* so join configurations substitute InOrder (Orders <- InOrder) to keep   *)
(* the state space small. Every order is checked in quick_nonjoin_3_uneven *)
(* (and _balanced), quick_nonjoin_2x4_regroup, mutant_no_chain,           *)
(* sanity_nonjoin_empty_rank and the                                       *)
(* conformance scenario nonjoin_2x4_shuffled (all invariants, safety);     *)
(* quick_nonjoin_2x4 (_all_ready_cap1: T = 1) and deep_nonjoin_3x3 keep    *)
(* InOrder for time.                                                       *)
Perms(n) == {f \in [1..n -> 1..n] : Range(f) = 1..n}
\* T <= the largest shard (T <= S_min+ or a rank's group count); constant-level, so TLC computes it once
PermTable == [n \in 0..Max({NV[r] : r \in Ranks} \cup {0}) |-> Perms(n)]
PermsOf(T) == IF T \in DOMAIN PermTable THEN PermTable[T] ELSE Perms(T)
AnyOrder(al, T) == {[r \in Ranks |-> [i \in 1..T |-> al[r][f[r][i]]]] : f \in [Ranks -> PermsOf(T)]}
InOrder(al, T) == {al}
Orders(al, T) == AnyOrder(al, T)
\* Trace validation: the recorded next lastOut, if it reorders each rank's aligned items
\* (they are distinct non-empty groups, or all idle, so equal ranges and lengths suffice).
IsOrderOf(o, al) == \A r \in Ranks : Len(o[r]) = Len(al[r]) /\ Range(o[r]) = Range(al[r])
RecordedOrder(al, T) == IF IsOrderOf(lastOut', al) THEN {lastOut'} ELSE {}

(* The shared tail's claims (odb_core.tail.tail_claims), from the state  *)
(* the headers report: a rank's load (the sum of its buffer's lengths),  *)
(* its pending views (R and Q) and buffered samples. In integers: the    *)
(* mean length is TotL / TotS; a rank's work W(r) = load x TotS + pending *)
(* x TotL; the level is the least h with sum max(0, h - W(r)) >= the      *)
(* pool's work (views left x TotL); in rank order, each rank with nothing *)
(* pending takes min(ClaimCap, (h - W(r)) \div TotL, what is left); if   *)
(* nobody takes any while a rank has nothing pending, the least-loaded    *)
(* such rank (lowest rank on ties) takes one.                             *)
(* The packed budget with regroup keeps a reserve of floor(W x Budget x   *)
(* TotS / TotL) views (all of the pool while TotL = 0) and deals only the *)
(* pool beyond it as above; once at most the reserve is left, a gather    *)
(* deals one view each to the FillK ranks with nothing pending and the     *)
(* most room (rm, RoomOf; lowest rank on ties), or, if none has room, to   *)
(* the FillK least-loaded such ranks (lowest rank on ties).               *)
Ld(r) == SumSeq([k \in DOMAIN B[r] |-> LenOf(r, B[r][k])])
TotL == SumSeq([r \in Ranks |-> Ld(r)])
TotS == SumSeq([r \in Ranks |-> Len(B[r])])
MeanNum == IF TotS > 0 /\ TotL > 0 THEN TotL ELSE 1
MeanDen == IF TotS > 0 /\ TotL > 0 THEN TotS ELSE 1
Work(r) == Ld(r) * MeanDen + Pend(r) * MeanNum
PoolLeft == Len(Pool) - pc
\* w: every rank's Work, computed once per gather (a function, so TLC does not re-evaluate it)
Fill(w, h) == SumSeq([r \in Ranks |-> IF h > w[r] THEN h - w[r] ELSE 0])
RECURSIVE LevelIn(_, _, _, _)
\* the least h in lo..hi with Fill(w, h) >= p (binary search, as odb_core.tail._level)
LevelIn(w, lo, hi, p) ==
    IF lo >= hi THEN lo
    ELSE CHOOSE v \in {IF Fill(w, mid) >= p THEN LevelIn(w, lo, mid, p) ELSE LevelIn(w, mid + 1, hi, p)
                       : mid \in {(lo + hi) \div 2}} : TRUE
Level(w, m, n) == LevelIn(w, Min({w[r] : r \in Ranks}), Max({w[r] : r \in Ranks}) + n * m, n * m)
RECURSIVE DealClaims(_, _, _, _, _)
\* the counts of ranks r..W given `room` views left, level h, works w and mean numerator m
DealClaims(r, room, h, w, m) ==
    IF r > W THEN <<>>
    ELSE CHOOSE v \in {<<c>> \o DealClaims(r + 1, room - c, h, w, m)
                       : c \in {IF Pend(r) = 0 /\ room > 0 /\ h > w[r] THEN Min({ClaimCap, (h - w[r]) \div m, room})
                                ELSE 0}} : TRUE
\* (values bound with CHOOSE x \in {e} : TRUE, evaluated once: see the B(l) walk's note)
ClaimsFor(w, m, n) ==
    CHOOSE c \in {IF SumSeq(d) > 0 \/ free = {} THEN d
                  ELSE [r \in Ranks |-> IF r = (CHOOSE x \in free : \A y \in free : w[x] < w[y] \/ (w[x] = w[y] /\ x <= y))
                                        THEN 1 ELSE 0]
                  : d \in {DealClaims(1, n, h, w, m) : h \in {Level(w, m, n)}},
                    free \in {{r \in Ranks : Pend(r) = 0}}} : TRUE
FillOn == BudgetKind = "packed" /\ RegroupDen > 0
Reserve == IF ~FillOn THEN 0 ELSE IF TotL > 0 THEN (W * Budget * TotS) \div TotL ELSE PoolLeft
\* the reserve's round: one view to each of the k roomiest ranks with nothing pending (room
\* rm[r] > 0, lowest rank on ties), or, if none has room, to each of the k least-loaded ones
FillK == Min({PoolLeft, (W + ReserveDiv - 1) \div ReserveDiv})
Ahead(S, better(_, _), r) == Cardinality({q \in S : better(q, r)})
FillClaim(rm) ==
    CHOOSE c \in {IF roomy # {}
                  THEN [r \in Ranks |-> IF r \in roomy /\ Ahead(roomy, LAMBDA q, x : rm[q] > rm[x] \/ (rm[q] = rm[x] /\ q < x), r) < k
                                        THEN 1 ELSE 0]
                  ELSE [r \in Ranks |-> IF r \in free /\ Ahead(free, LAMBDA q, x : Ld(q) < Ld(x) \/ (Ld(q) = Ld(x) /\ q < x), r) < k
                                        THEN 1 ELSE 0]
                  : free \in {{r \in Ranks : Pend(r) = 0}}, roomy \in {{r \in Ranks : Pend(r) = 0 /\ rm[r] > 0}},
                    k \in {FillK}} : TRUE
\* the reserve's claim as Claims uses it (a .cfg substitutes a seeded bug here)
FillOp(rm) == FillClaim(rm)
Claims(rm) == IF pc = Len(Pool) THEN [r \in Ranks |-> 0]
              ELSE IF FillOn /\ PoolLeft <= Reserve THEN FillOp(rm)
              ELSE CHOOSE c \in {ClaimsFor(w, MeanNum, PoolLeft - Reserve) : w \in {[r \in Ranks |-> Work(r)]}} : TRUE
\* claimed' and pc' for the counts c (each rank's pool indices follow those of the ranks before it)
ClaimWith(c) ==
    /\ claimed' = [r \in Ranks |-> claimed[r] \o [i \in 1..c[r] |-> pc + SumSeq(SubSeq(c, 1, r - 1)) + i]]
    /\ pc' = pc + SumSeq(c)

(* What stays in B after a rank emitted `em`: overflow recirculates.       *)
Rest(r, ready, em) == SelectSeq(B[r], LAMBDA p : p \notin em)
ChainOn == TRUE

---------------------------------------------------------------------------
Init == /\ next = [r \in Ranks |-> 1]
        /\ Q = [r \in Ranks |-> {}]
        /\ B = [r \in Ranks |-> <<>>]
        /\ E = [r \in Ranks |-> {}]
        /\ H = [r \in Ranks |-> {}]
        /\ consumed = 0
        /\ lastStep = 0
        /\ lastOut = [r \in Ranks |-> <<>>]
        /\ rounds = 0
        /\ done = (~JoinMode /\ Quota = 0)
        /\ pc = 0
        /\ claimed = [r \in Ranks |-> <<>>]

(* R -> Q while |Q| + |B \ H| < D, all at once (odb_core's fetch()). A     *)
(* stream's fetch is bounded by the depth alone until its end is known;    *)
(* positions past the end do not enter Q, and next[r] = NV[r] + 2 says the *)
(* end is known (odb_core: fetch, then end_stream when a read finds it).   *)
Fetch(r) ==
    /\ ~done
    /\ LET room == Depth - Cardinality(Q[r]) - (Len(B[r]) - Cardinality(H[r]))
           avail == IF StreamOn THEN (IF EndKnown(r) THEN 0 ELSE room) ELSE NVr(r) - next[r] + 1
           take == IF room < avail THEN room ELSE avail
           last == next[r] + take - 1
       IN /\ take > 0
          /\ Q' = [Q EXCEPT ![r] = @ \cup StreamFetched(r, last)]
          /\ next' = [next EXCEPT ![r] = IF StreamOn /\ last > NV[r] THEN NV[r] + 2 ELSE last + 1]
    /\ UNCHANGED <<B, E, H, consumed, lastStep, lastOut, rounds, done, pc, claimed>>

(* One in-flight sample arrives, in any order: Q -> B.                     *)
Drain(r, p) ==
    /\ ~done
    /\ p \in Q[r]
    /\ Q' = [Q EXCEPT ![r] = @ \ {p}]
    /\ B' = [B EXCEPT ![r] = Append(@, p)]
    /\ UNCHANGED <<next, E, H, consumed, lastStep, lastOut, rounds, done, pc, claimed>>

EndIteration ==
    IF JoinMode \/ ~ChainOn
    THEN /\ done' = TRUE
         /\ lastOut' = [r \in Ranks |-> <<>>]
         /\ UNCHANGED <<next, Q, B, E, H, consumed, lastStep, rounds, pc, claimed>>
    ELSE \* non-join: the trainer chains the next logical iteration
         /\ next' = [r \in Ranks |-> 1]
         /\ Q' = [r \in Ranks |-> {}]
         /\ B' = [r \in Ranks |-> <<>>]
         /\ E' = [r \in Ranks |-> {}]
         /\ H' = [r \in Ranks |-> {}]
         /\ rounds' = 0
         /\ lastOut' = [r \in Ranks |-> <<>>]
         /\ UNCHANGED <<consumed, lastStep, done, pc, claimed>>

(* Values are bound with \E x \in {e} rather than LET so TLC computes them *)
(* once per step, also when it checks fairness (LET is re-evaluated there). *)
Emit(st, gs, hs, T, O(_, _), c) ==
    \E kh \in {[r \in Ranks |-> IF st[r] = "ready" THEN StillHeld(gs[r], hs[r], T) ELSE {}]} :
    \E al \in {[r \in Ranks |-> IF st[r] = "ready" THEN AlignOp(r, Pick(gs[r], DOMAIN gs[r] \ kh[r]), T)
                                ELSE [i \in 1..T |-> <<>>]]} :
    \E out \in O(al, T) :
    \E em \in {[r \in Ranks |-> UNION {Range(g) : g \in Range(out[r])}]} :
    \* non-join: the trainer consumes steps, in order, until the quota is reached
    \E step \in {[i \in 1..T |-> SumSeq([r \in Ranks |-> IF i <= Len(out[r]) THEN Len(out[r][i]) ELSE 0])]} :
    \E cum \in {[k \in 0..T |-> SumSeq(SubSeq(step, 1, k))]} :
    \E k \in {IF \E j \in 1..T : consumed + cum[j] >= Quota
              THEN Min({j \in 1..T : consumed + cum[j] >= Quota}) ELSE T} :
       /\ B' = [r \in Ranks |-> Rest(r, st[r] = "ready", em[r])]
       /\ E' = [r \in Ranks |-> E[r] \cup em[r]]
       /\ H' = [r \in Ranks |-> IF st[r] = "ready" THEN UNION {Range(gs[r][i]) : i \in kh[r]} ELSE H[r]]
       /\ lastOut' = out
       /\ rounds' = rounds + 1
       /\ IF JoinMode
          THEN UNCHANGED <<consumed, lastStep, done>>
          ELSE /\ consumed' = consumed + cum[k]
               /\ lastStep' = step[k]
               /\ done' = (consumed + cum[k] >= Quota)
       /\ ClaimWith(c)
       /\ UNCHANGED <<next, Q>>

(* One atomic round for all ranks: header gather, align, step gather, emit.*)
(* P is the grouping: the budget's rule (Packing) by default; trace        *)
(* validation replays recorded groupings (checked to equal Packing).       *)
(* O is the set of emission orders (Orders; RecordedOrder when replaying). *)
GatherWith(P(_), O(_, _)) ==
    /\ ~done
    /\ \E st0 \in {[r \in Ranks |-> Status(r)]} :
       \E gs \in {[r \in Ranks |-> IF st0[r] = "ready" THEN P(r) ELSE <<>>]} :
       \E hs \in {[r \in Ranks |-> HoldIdx(r, gs[r])]} :
       \E st \in {HeldStatus(st0, gs, hs)} :
       \E T \in {Target(st, [r \in Ranks |-> Len(gs[r]) - Cardinality(hs[r])], [r \in Ranks |-> Len(B[r])])} :
          IF IF JoinMode THEN \A r \in Ranks : st[r] = "finished"
             ELSE \E r \in Ranks : st[r] = "finished"
          THEN EndIteration
          ELSE \E c \in {Claims(RoomOf(gs, hs))} :
               IF T = 0
               THEN /\ lastOut' = [r \in Ranks |-> <<>>]
                    /\ ClaimWith(c)
                    /\ UNCHANGED <<next, Q, B, E, H, consumed, lastStep, rounds, done>>
               ELSE Emit(st, gs, hs, T, O, c)
Gather == GatherWith(Packing, Orders)

Terminating == done /\ UNCHANGED vars

Next == \/ \E r \in Ranks : Fetch(r)
        \/ \E r \in Ranks : \E p \in Views(r) : Drain(r, p)
        \/ Gather
        \/ Terminating

(* Fairness: weak fairness of the one action "some Fetch, some Drain or a *)
(* Gather". WF of each part implies WF of their disjunction (once no step *)
(* occurs the state is constant, so whichever part is enabled stays so),  *)
(* so this assumes less than per-action fairness and Termination under it *)
(* is the stronger claim. It is also TLC's cheapest form: ENABLED stops at *)
(* the first enabled disjunct (2.4x faster on quick_nonjoin_3_uneven); a *)
(* per (rank, view) form gives a 2^k tableau. Every Drain and Fetch is     *)
(* progress, so they cannot starve the Gather for ever. The sanity         *)
(* configurations check that dropping Drain or Gather breaks Termination.  *)
DrainAny == \E r \in Ranks : \E p \in Views(r) : Drain(r, p)
FetchAny == \E r \in Ranks : Fetch(r)
Fairness == WF_vars(FetchAny \/ DrainAny \/ Gather)
Spec == Init /\ [][Next]_vars /\ Fairness
\* Sanity: these must NOT satisfy Termination; CI checks that TLC refutes them.
SpecNoDeliveryFairness == Init /\ [][Next]_vars /\ WF_vars(FetchAny \/ Gather)
SpecNoGatherFairness == Init /\ [][Next]_vars /\ WF_vars(FetchAny \/ DrainAny)

---------------------------------------------------------------------------
(* Properties.                                                             *)
TypeOK ==
    /\ next \in [Ranks -> Nat] /\ \A r \in Ranks : next[r] \in 1..(NVr(r) + IF StreamOn THEN 2 ELSE 1)
    /\ pc \in 0..Len(Pool) /\ \A r \in Ranks : claimed[r] \in Seq(1..Len(Pool))
    /\ \A r \in Ranks : Q[r] \subseteq Views(r) /\ E[r] \subseteq Views(r) /\ H[r] \subseteq Views(r)
    /\ \A r \in Ranks : B[r] \in Seq(Views(r))
    /\ consumed \in Nat /\ lastStep \in Nat /\ rounds \in Nat /\ done \in BOOLEAN

\* P1 No-Leak: R, Q, B, E partition each rank's views.
NoLeak ==
    \A r \in Ranks :
        /\ Cardinality(Range(B[r])) = Len(B[r])
        /\ Remaining(r) \cap Q[r] = {} /\ Remaining(r) \cap Range(B[r]) = {} /\ Remaining(r) \cap E[r] = {}
        /\ Q[r] \cap Range(B[r]) = {} /\ Q[r] \cap E[r] = {} /\ Range(B[r]) \cap E[r] = {}
        /\ Remaining(r) \cup Q[r] \cup Range(B[r]) \cup E[r] = Views(r)

\* Memory: a rank holds at most 2D samples in Q and B, at most D of them held (HeldOK);
\* with regroup off (H always empty) at most D. Inductive: a fetch leaves
\* |Q| + |B \ H| <= D, so |Q| + |B| <= D + |H| <= 2D; a gather only shrinks B and
\* holds at most D samples; chaining empties both. (|Q| + |B \ H| <= D does not hold:
\* a sample released from H but not emitted counts toward D again.)
DepthBound == \A r \in Ranks :
    /\ Cardinality(Q[r]) + Len(B[r]) <= 2 * Depth
    /\ (RegroupDen = 0 => Cardinality(Q[r]) + Len(B[r]) <= Depth)

\* Regroup: held samples are buffered samples, at most D of them (HoldIdx's cap).
HeldOK == \A r \in Ranks : H[r] \subseteq Range(B[r]) /\ Cardinality(H[r]) <= Depth

\* P2 Lockstep: every rank emitted the same number of items in the last round.
Lockstep == \A r, s \in Ranks : Len(lastOut[r]) = Len(lastOut[s])

\* P3 Budget: no emitted group of >= 2 samples costs more than L_max (per BudgetKind).
BudgetOK == \A r \in Ranks : \A i \in DOMAIN lastOut[r] : WithinBudget(r, lastOut[r][i])

WithinCapacity == Capacity > 0 => \A r \in Ranks : Len(lastOut[r]) <= Capacity

\* (named for the B(l) rule; it checks the budget's rule: BRule or PackRule)
BRuleAdmissible == \A r \in Ranks : Status(r) = "ready" => Admissible(r, Packing(r))

\* P4 Join coverage: at termination every view was emitted.
JoinCoverage == (JoinMode /\ done) => pc = Len(Pool) /\ \A r \in Ranks : E[r] = Views(r)

\* The views of rank r's items of the last round.
RoundViews(out) == UNION {Range(g) : g \in Range(out)}

\* P4 exactly once, within a round: no view in two items of a round, nor twice in one item
\* (E' = E \cup em absorbs a repeat: NoLeak and JoinCoverage compare sets).
NoDupInRound == \A r \in Ranks :
    SumSeq([i \in DOMAIN lastOut[r] |-> Len(lastOut[r][i])]) = Cardinality(RoundViews(lastOut[r]))

\* P4 exactly once, across rounds (an action property): a round emits buffered views only, so
\* none emitted before (NoLeak: B and E are disjoint) and none not yet fetched.
EmitFromBuffer == [][\A r \in Ranks : rounds' # rounds => RoundViews(lastOut'[r]) \subseteq Range(B[r])]_vars

\* The shared tail: the claimed pool indices are 1..pc, each claimed by one rank once.
PoolOnce == /\ SumSeq([r \in Ranks |-> Len(claimed[r])]) = pc
            /\ UNION {Range(claimed[r]) : r \in Ranks} = 1..pc

\* P5 Quota closure: N <= S_emit < N + last step (so <= N + S_max).
QuotaClosure == (~JoinMode /\ done) =>
                    /\ consumed >= Quota
                    /\ (Quota > 0 => consumed - lastStep < Quota)

\* Round bound: each emitting round emits >= 1 view.
RoundBound == rounds <= SumSeq(NV) + Len(Pool)

\* P6 Termination.
Termination == <>done
=============================================================================
