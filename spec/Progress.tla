------------------------------ MODULE Progress ------------------------------
(***************************************************************************)
(* A progress property that can fail, as safety (state predicates).        *)
(*                                                                         *)
(* TLC's deadlock check is vacuous on ODB: the gather's T = 0 branch (a    *)
(* skip round) is enabled in every state that is not done, so no state    *)
(* ever lacks a successor, however stuck the protocol is. A skip round     *)
(* changes nothing but lastOut. So a state in which no sample can move (no *)
(* Fetch, no Drain enabled) and the gather would skip is a livelock: the   *)
(* next state is the same state, its gather skips again, for ever. The     *)
(* bound on consecutive skip rounds taken with nothing else enabled is     *)
(* therefore K = 0: one such skip is already infinitely many.              *)
(*                                                                         *)
(*  QuiescentProgress: in a state that is not done and in which no sample *)
(*    can move, the gather is not a skip round (it emits, or ends the      *)
(*    epoch or the logical iteration), or it claims a pool view (a packed  *)
(*    pool hold waits for claims; pc grows at most Len(Pool) times).       *)
(*  IterationProgress: a non-join iteration ends only after it emitted (a  *)
(*    chain that emitted nothing restarts the same iteration, for ever).   *)
(*                                                                         *)
(* With fair delivery (every Fetch and Drain eventually taken) these two   *)
(* leave no way not to progress: between two emitting rounds each rank     *)
(* fetches at most once and drains at most D views (|Q| + |B \ H| is       *)
(* bounded by D and only an emission lowers it), so after finitely many    *)
(* moves every state is quiescent and the gather must emit or end.         *)
(* Termination (<>done under Spec's fairness) stays the liveness check on  *)
(* the quick configurations; these invariants also run where liveness      *)
(* cannot: in simulation at W = 8 and on the inductive domains.            *)
(* The resumed runs (TailResume, Elastic: ODB from a resumed initial       *)
(* state) are checked in a module extending theirs and this one            *)
(* (model_checks/progress.py module_text).                                 *)
(*                                                                         *)
(* Seeded bugs that must violate them (model_checks/reach.py):             *)
(*  MutTargetFinishedBlocks: "all-ready" that counts a finished rank as    *)
(*    not ready, so once a rank runs out the others wait for ever.         *)
(*  MutStatusNoFlush: a drained rank with a part-filled buffer never       *)
(*    reports ready (the flush forgotten).                                 *)
(* Neither makes TLC report a deadlock: the skip round is always enabled.  *)
(***************************************************************************)
EXTENDS MC

\* Some sample can move: a rank can fetch, or a requested sample can arrive.
CanMove == (\E r \in Ranks : ENABLED Fetch(r)) \/ (\E r \in Ranks : Q[r] # {})

\* The gather's plan, computed as GatherWith computes it (statuses, packing, holds,
\* target); simulation (Reach.tla) asserts on every gather that the plan agrees with
\* what the gather did. (ENABLED of a gather that changes nothing but lastOut says
\* the same, but TLC evaluates the gather under ENABLED orders of magnitude slower.)
IterationEnds ==
    IF JoinMode THEN \A r \in Ranks : Status(r) = "finished" ELSE \E r \in Ranks : Status(r) = "finished"
PlanStatus == [r \in Ranks |-> Status(r)]
PlanGroups == [r \in Ranks |-> IF PlanStatus[r] = "ready" THEN Packing(r) ELSE <<>>]
PlanHeld == [r \in Ranks |-> HoldIdx(r, PlanGroups[r])]
PlanTarget ==
    LET gs == PlanGroups
        hs == PlanHeld
    IN Target(HeldStatus(PlanStatus, gs, hs), [r \in Ranks |-> Len(gs[r]) - Cardinality(hs[r])],
              [r \in Ranks |-> Len(B[r])])
WouldSkip == ~IterationEnds /\ PlanTarget = 0
\* a packed pool hold's gather claims a pool view (pc grows: at most Len(Pool) times, so not a
\* livelock); without a pool hold a quiescent skip round is a livelock, claims or not
PlanClaims == (\E r \in Ranks : PoolHold(r)) /\ SumSeq(Claims(RoomOf(PlanGroups, PlanHeld))) > 0

QuiescentProgress == (~done /\ ~CanMove) => ~WouldSkip \/ PlanClaims

IterationProgress ==
    (~JoinMode /\ ~done /\ \E r \in Ranks : Status(r) = "finished") => rounds > 0

ProgressOK == QuiescentProgress /\ IterationProgress

---------------------------------------------------------------------------
(* Seeded bugs for the progress check.                                     *)
MutTargetFinishedBlocks(st, G, S) ==
    IF \E r \in Ranks : st[r] # "ready" THEN 0 ELSE PaperTarget(st, G, S)
MutStatusNoFlush(r) ==
    IF IsFinished(r) THEN "finished"
    ELSE IF B[r] # <<>> /\ Len(B[r]) - Cardinality(H[r]) >= BufSize THEN "ready"
    ELSE "waiting"
---------------------------------------------------------------------------
(* Seeded bugs for the simulation (Reach.tla) that the toy models miss:   *)
(* every quick configuration passes with MutAlignSplit3; the 2x4 ones pass *)
(* with MutRestKeep4 (the 8-view W=1 ones catch it).                      *)
\* a rank short of T groups splits at most 3 times (Lockstep breaks when it needs more)
MutAlignSplit3(r, gs, T) ==
    IF Len(gs) + 3 < T THEN SplitTo(gs, Len(gs) + 3) ELSE Align(r, gs, T)
\* a ready rank keeps at most 4 samples of overflow and held groups, dropping the rest (NoLeak)
MutRestKeep4(r, ready, em) ==
    LET rest == SelectSeq(B[r], LAMBDA p : p \notin em)
    IN IF ready /\ Len(rest) > 4 THEN SubSeq(rest, 1, 4) ELSE rest
=============================================================================
