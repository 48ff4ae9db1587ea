----------------------------- MODULE TailResume -----------------------------
(***************************************************************************)
(* A pooled epoch (the shared tail) resumed mid-epoch on the same ranks    *)
(* (odb_core/tail.py resumed_positions). Before the checkpoint, rank r     *)
(* held its own views (lengths OwnLen[r], sampler positions 1..NOwn(r))    *)
(* and the pool views it claimed (pool index j at position NOwn(r) + j);   *)
(* Cursor0 pool views were claimed by every rank, Claimed0[r] by r (pool   *)
(* indices, in order); Used0[r] holds the positions r yielded. ResumedOp(r)*)
(* is r's views in the resumed run: its own positions not yielded, then    *)
(* its claims not yielded; the pool goes on from the cursor (TailPool). A  *)
(* configuration sets NV <- TailNV, Length <- TailLength and Pool <-       *)
(* TailPool, so ODB runs unchanged from that initial state;                *)
(* ResumeExactlyOnce checks both runs together: every own view and every   *)
(* pool view of the epoch yielded exactly once (P4 across the resume).     *)
(***************************************************************************)
EXTENDS ODB

CONSTANTS OwnLen,    \* per rank, the lengths of its own views
          PoolLen,   \* the lengths of the epoch's pool
          Cursor0,   \* pool views claimed (by every rank) before the checkpoint
          Claimed0,  \* per rank, the pool indices it claimed before, in claim order
          Used0      \* per rank, the sampler positions it yielded before

ASSUME Cursor0 \in 0..Len(PoolLen)
\* the claims split 1..Cursor0 over the ranks (each index once); a rank yielded only its own
\* positions and those of its claims
ASSUME /\ \A r \in 1..W : Cardinality(Range(Claimed0[r])) = Len(Claimed0[r])
       /\ \A r, s \in 1..W : r # s => Range(Claimed0[r]) \cap Range(Claimed0[s]) = {}
       /\ UNION {Range(Claimed0[r]) : r \in 1..W} = 1..Cursor0
       /\ \A r \in 1..W : Used0[r] \subseteq 1..Len(OwnLen[r]) \cup {Len(OwnLen[r]) + j : j \in Range(Claimed0[r])}

NOwn(r) == Len(OwnLen[r])
OwnLeft(r) == SelectSeq([p \in 1..NOwn(r) |-> p], LAMBDA p : p \notin Used0[r])
ClaimLeft(r) == SelectSeq(Claimed0[r], LAMBDA j : NOwn(r) + j \notin Used0[r])
Resumed(r) == OwnLeft(r) \o [k \in 1..Len(ClaimLeft(r)) |-> NOwn(r) + ClaimLeft(r)[k]]
ResumedOp(r) == Resumed(r)

SrcLen(r, s) == IF s <= NOwn(r) THEN OwnLen[r][s] ELSE PoolLen[s - NOwn(r)]
TailNV == [r \in 1..W |-> Len(ResumedOp(r))]
TailLength == [r \in 1..W |-> [p \in 1..Len(ResumedOp(r)) |-> SrcLen(r, ResumedOp(r)[p])]]
TailPool == [k \in 1..(Len(PoolLen) - Cursor0) |-> PoolLen[Cursor0 + k]]

\* What each rank yielded over both runs: its own positions, and pool indices (before the
\* checkpoint, its re-dealt claims after it, and its claims of the resumed run's pool).
Src(r, p) == ResumedOp(r)[p]
OwnYielded(r) == {u \in Used0[r] : u <= NOwn(r)} \cup {Src(r, p) : p \in {q \in E[r] : q <= NV[r] /\ Src(r, q) <= NOwn(r)}}
PoolBefore(r) == {u - NOwn(r) : u \in {v \in Used0[r] : v > NOwn(r)}}
PoolRedealt(r) == {Src(r, p) - NOwn(r) : p \in {q \in E[r] : q <= NV[r] /\ Src(r, q) > NOwn(r)}}
PoolNew(r) == {Cursor0 + claimed[r][p - NV[r]] : p \in {q \in E[r] : q > NV[r]}}
PoolYielded(r) == PoolBefore(r) \cup PoolRedealt(r) \cup PoolNew(r)

ResumeExactlyOnce ==
    /\ \A r \in Ranks : Cardinality(Range(ResumedOp(r))) = Len(ResumedOp(r))  \* no view served twice
    /\ \A r \in Ranks : Range(ResumedOp(r)) \cap Used0[r] = {}
    /\ \A r \in Ranks : PoolBefore(r) \cap PoolRedealt(r) = {} /\ (PoolBefore(r) \cup PoolRedealt(r)) \cap PoolNew(r) = {}
    /\ \A r, s \in Ranks : r # s => PoolYielded(r) \cap PoolYielded(s) = {}
    /\ done => /\ \A r \in Ranks : OwnYielded(r) = 1..NOwn(r)
               /\ UNION {PoolYielded(r) : r \in Ranks} = 1..Len(PoolLen)

\* Model values: two ranks of two own views and a pool of three; before the checkpoint the
\* ranks claimed two pool views (rank 1: 1, rank 2: 2), rank 1 yielded its own view 1 and pool
\* view 1 (position 3), rank 2 nothing. Rank 2 re-serves pool view 2; view 3 stays in the pool.
OwnLen_T == <<<<6, 2>>, <<1, 5>>>>
PoolLen_T == <<3, 1, 4>>
Cursor_T == 2
Claimed_T == <<<<1>>, <<2>>>>
Used_T == <<{1, 3}, {}>>

\* Seeded bug: the resume forgets the claimed views not yet yielded (they were loaded by their
\* claimer, never yielded, and no rank serves them again: lost).
MutForgetClaims(r) == OwnLeft(r)
\* Seeded bug: the rank's own views not yet yielded are served twice (each trained twice).
MutServeTwice(r) == Resumed(r) \o OwnLeft(r)
=============================================================================
