--------------------------------- MODULE MC ---------------------------------
(***************************************************************************)
(* Model values for the configurations in spec/cfg/, and the seeded bugs   *)
(* (mutants) a .cfg substitutes for ODB's operators. M1-M7, M9, M10 and   *)
(* F1 have a twin in model_checks/mutants.py and must be caught by TLC    *)
(* and by the hypothesis suite; M8's twin is                               *)
(* tests/test_stream_properties.py's; F2 and F3 have none (the reach      *)
(* simulation and the pooled inductiveness check catch them; the hunts    *)
(* catch the core's own pool bugs, double-deal and drop-last-claim).      *)
(***************************************************************************)
EXTENDS ODB

\* Two ranks, four views each: a short-heavy rank and one with an over-budget view (Budget 10).
NV_2x4 == <<4, 4>>
Len_2x4 == <<<<2, 3, 6, 9>>, <<1, 1, 5, 12>>>>
\* Three ranks with uneven shards.
NV_3u == <<3, 2, 1>>
Len_3u == <<<<1, 4, 8>>, <<2, 2>>, <<7>>>>
\* Three ranks, the last with no data at all.
NV_3e == <<3, 2, 0>>
Len_3e == <<<<1, 4, 8>>, <<2, 2>>, <<>>>>
\* Regroup: buffers of 3 form padded pairs that are held back (H) and regrouped.
NV_2x4r == <<4, 4>>
Len_2x4r == <<<<1, 3, 2, 4>>, <<2, 2, 5, 1>>>>
\* Depth bound under regroup: one rank whose short pairs are held, then released but not
\* emitted (capacity 1), while the fetch refills D: before holds were capped at D,
\* |Q| + |B| reached 5 with H empty (the old DepthBound, |Q| + |B \ H| <= D = 4, failed).
NV_1d == <<8>>
Len_1d == <<<<1, 1, 3, 3, 10, 10, 10, 10>>>>
\* Holds capped at D: a rank that emits one group a round (capacity 1) while it holds and
\* releases pairs collects more than D holdable samples; uncapped, it held 4 > D = 3 and
\* then fetched to |Q| + |B| = 7 > 2D.
NV_1c == <<12>>
Len_1c == <<<<0, 3, 3, 0, 0, 2, 0, 2, 0, 10, 10, 10>>>>
\* Packed budget (BudgetKind = "packed", Budget 10): samples the B(l) walk keeps apart
\* pack together (1 + 8, 3 + 3 + 4), 11 is over the budget (alone), and a first buffer of
\* {1, 8, 5} packs into [5] and [1, 8], which leaves 10% of its budget unused: regroup holds it.
NV_2x4p == <<4, 4>>
Len_2x4p == <<<<1, 8, 5, 7>>, <<3, 3, 4, 11>>>>
\* Best fit, not first fit (Budget 20, one buffer of 4): 12 and 10 open groups with room
\* 8 and 10, 9 goes to the second (room 1), and 1 goes to the fullest group it fits in,
\* the second (first fit would put it in the first).
NV_1b == <<4>>
Len_1b == <<<<1, 9, 12, 10>>>>
\* The shared tail: two ranks of uneven work (rank 1 long, rank 2 short) and a pool of four
\* views both know; rank 2 runs out of work first and the claims go to it.
NV_2t == <<2, 2>>
Len_2t == <<<<6, 7>>, <<1, 2>>>>
Pool_2t == <<3, 1, 4, 2>>
\* ReserveDiv <- Div_1: the reserve deals to every free rank at once (k = W; the default 8 gives k = 1 at W <= 8)
Div_1 == 1
\* Deep suite: three ranks, three views each.
NV_3x3 == <<3, 3, 3>>
Len_3x3 == <<<<2, 6, 9>>, <<1, 5, 12>>, <<4, 4, 0>>>>

---------------------------------------------------------------------------
\* M1: target without C_min+ (ignores output capacity).
MutTargetNoCmin(st, G, S) ==
    IF Active(st) = {} THEN 0
    ELSE LET m == Min({Max({G[r] : r \in Active(st)})} \cup {S[r] : r \in Active(st)})
         IN IF m < 1 THEN 1 ELSE m
\* M2: target fixed to max G (ignores C_min+ and S_min+).
MutTargetMaxGroups(st, G, S) == IF Active(st) = {} THEN 0 ELSE Max({G[r] : r \in Active(st)})
\* M3: overflow dropped instead of recirculated.
MutRestDrop(r, ready, em) == IF ready THEN <<>> ELSE B[r]
\* M4: finish announced while the buffer still holds samples.
MutIsFinishedEarly(r) == Drained(r)
\* M5: overflow merged into the last kept group instead of recirculated (breaks the budget).
RECURSIVE Flat(_)
Flat(gs) == IF gs = <<>> THEN <<>> ELSE Head(gs) \o Flat(Tail(gs))
MutAlignMerge(r, gs, T) ==
    IF Len(gs) > T
    THEN LET kept == KeepTop(r, gs, T)
             kset == UNION {Range(g) : g \in Range(kept)}
             extra == SelectSeq(Flat(gs), LAMBDA p : p \notin kset)
         IN [kept EXCEPT ![T] = @ \o extra]
    ELSE Align(r, gs, T)
\* M6: non-join without chaining of logical iterations.
MutChainOff == FALSE
\* M7: the packed budget's best fit ignores the sample's own size: a sample goes into the
\* fullest group with any room left, whether it fits or not (breaks the packed BudgetOK).
MutFitsOverfill(loads, s) == {i \in DOMAIN loads : loads[i] < Budget}
\* M8: a stream's end mapped one position early (odb_core: EndsOneEarlyDriver): the fetch that
\* reveals the end leaves the stream's last view out of Q, so it is never emitted.
MutStreamEndEarly(r, last) == next[r]..(IF last > NV[r] THEN NV[r] - 1 ELSE last)
\* M9: a split leaves the split-off sample in its group as well (odb_core twin: SplitDupDriver),
\* so that view is emitted twice in one round (breaks NoDupInRound; NoLeak and JoinCoverage hold).
RECURSIVE DupSplitTo(_, _)
DupSplitTo(gs, T) ==
    IF Len(gs) >= T THEN gs
    ELSE LET big == {i \in 1..Len(gs) : Len(gs[i]) >= 2}
         IN IF big = {} THEN gs
            ELSE LET i == Max(big)
                 IN DupSplitTo(SubSeq(gs, 1, i) \o <<<<gs[i][Len(gs[i])]>>>> \o SubSeq(gs, i + 1, Len(gs)), T)
MutAlignDup(r, gs, T) == IF Len(gs) < T THEN DupSplitTo(gs, T) ELSE Align(r, gs, T)
\* M10: the last item of a round of two or more is the rank's first non-idle item of the
\* previous round again (odb_core twin: ReemitDriver); the group it displaces stays in B. Views
\* emitted before are emitted again, from E rather than B (breaks EmitFromBuffer; every
\* invariant holds: E' = E \cup em absorbs them).
MutAlignReemit(r, gs, T) ==
    LET al == Align(r, gs, T)
        real == {i \in DOMAIN lastOut[r] : Len(lastOut[r][i]) > 0}
    IN IF real # {} /\ T >= 2 THEN [al EXCEPT ![T] = lastOut[r][Min(real)]] ELSE al
\* F1: the packed budget's reserve deals its view only to a rank with room: once no rank with
\* nothing pending has a part-full group, the pool is never claimed again (breaks Termination).
MutFillNoFallback(rm) ==
    IF \E r \in Ranks : Pend(r) = 0 /\ rm[r] > 0 THEN FillClaim(rm) ELSE [r \in Ranks |-> 0]
\* F2: a claim's pool indices offset by the count of the rank just before only, not of all
\* ranks before: when two ranks with a third between them both claim at one gather, they are
\* dealt the same views, and the pool's last views nobody (breaks PoolOnce); at two ranks,
\* as in every quick configuration, it is the real ClaimWith (reach's seeded pool bug).
MutClaimWithPrevOnly(c) ==
    /\ claimed' = [r \in Ranks |-> claimed[r] \o [i \in 1..c[r] |-> pc + (IF r > 1 THEN c[r - 1] ELSE 0) + i]]
    /\ pc' = pc + SumSeq(c)
\* F3: a claim advances the pool's cursor without dealing its views to anyone (breaks
\* PoolOnce at once; the pooled inductiveness check's seeded bug).
MutClaimWithDrop(c) == claimed' = claimed /\ pc' = pc + SumSeq(c)
\* Two ranks whose single samples fill the budget exactly (nothing is held back) and a pool.
NV_2f == <<1, 1>>
Len_2f == <<<<10>>, <<10>>>>
Pool_2f == <<5, 5>>
=============================================================================
