------------------------------- MODULE Reach -------------------------------
(***************************************************************************)
(* Random simulation of ODB at sizes exhaustive checking cannot reach      *)
(* (W up to 8, tens of views per rank): TLC -simulate picks one enabled    *)
(* action at random per step and checks every invariant on every state.    *)
(* model_checks/reach.py writes a module extending this one with the       *)
(* constants (lengths drawn in Python) and runs it.                         *)
(*                                                                         *)
(* cov counts, per behaviour, the gathers that exercise the interesting     *)
(* branches; the step into done prints it (PrintT), and reach.py sums the  *)
(* lines: one per behaviour that reached done. A behaviour that has not    *)
(* reached done by level MaxLevel violates ReachedDone.                    *)
(***************************************************************************)
EXTENDS Progress

CONSTANT MaxLevel  \* -depth of the simulation; a behaviour must be done before it

VARIABLE cov       \* this behaviour's counts of interesting gathers

CovKeys == {"gathers", "emits", "skips", "chains", "splits", "overflows", "holds", "takebacks",
            "idle", "capped", "flushes", "oversize", "zeros", "quotacut", "claims"}

\* Emission orders for simulation (non-join: the quota depends on the order).
\* AnyOrder enumerates T!^W orders (too many at W = 8), so each emitting round
\* takes one of 2T orders at random: each rank's items rotated by k * r (mod T),
\* or that reversed. One order, not a set of them: the simulator would check
\* (and print at done) every successor.
Rot(s, j) == [i \in 1..Len(s) |-> s[((i - 1 + j) % Len(s)) + 1]]
SomeOrders(al, T) ==
    {[r \in Ranks |-> Rot(al[r], (k * r) % T)] : k \in 0..(T - 1)}
    \cup {[r \in Ranks |-> Reverse(Rot(al[r], (k * r) % T))] : k \in 0..(T - 1)}
RandomOrder(al, T) == {RandomElement(SomeOrders(al, T))}
NoPerms == <<>>

One(b) == IF b THEN 1 ELSE 0

\* Which branches the gather from this state to the next takes (lastOut', B', H' are
\* the gather's). The plan (statuses, packing, holds, target) is ODB's GatherWith's.
GatherCov ==
    \E st0 \in {[r \in Ranks |-> Status(r)]} :
    \E gs \in {[r \in Ranks |-> IF st0[r] = "ready" THEN Packing(r) ELSE <<>>]} :
    \E hs \in {[r \in Ranks |-> HoldIdx(r, gs[r])]} :
    \E st \in {HeldStatus(st0, gs, hs)} :
    \E ends \in {IF JoinMode THEN \A r \in Ranks : st[r] = "finished" ELSE \E r \in Ranks : st[r] = "finished"} :
    \E emit \in {~ends /\ rounds' = rounds + 1} :
    \E ready \in {{r \in Ranks : st[r] = "ready"}} :
    LET T == IF emit THEN Len(lastOut'[CHOOSE r \in Ranks : TRUE]) ELSE 0
        emitted(r) == {p \in Range(B[r]) : p \notin Range(B'[r])}
    IN cov' = [k \in CovKeys |-> cov[k] + One(
           CASE k = "gathers" -> TRUE
             [] k = "emits" -> emit
             [] k = "skips" -> ~ends /\ ~emit
             [] k = "chains" -> ends /\ ~JoinMode /\ ~done'
             \* a ready rank emits a group its packing did not have: a split piece
             [] k = "splits" -> emit /\ \E r \in ready : \E i \in DOMAIN lastOut'[r] : lastOut'[r][i] \notin Range(gs[r])
             \* a ready rank keeps samples in B that it does not hold: overflow
             [] k = "overflows" -> emit /\ \E r \in ready : Range(B'[r]) # H'[r]
             [] k = "holds" -> emit /\ \E r \in ready : H'[r] # {}
             \* a rank short of T groups emits some of the groups it would have held
             [] k = "takebacks" -> emit /\ \E r \in ready : \E i \in hs[r] : Range(gs[r][i]) \subseteq emitted(r)
             [] k = "idle" -> emit /\ ready # Ranks
             \* the output capacity binds: a ready rank had more groups than it may emit
             [] k = "capped" -> emit /\ Capacity > 0 /\ \E r \in ready : Len(gs[r]) - Cardinality(hs[r]) > Capacity
             \* a drained rank emits a buffer smaller than buffer_size
             [] k = "flushes" -> emit /\ \E r \in ready : Drained(r) /\ Len(B[r]) - Cardinality(H[r]) < BufSize
             [] k = "oversize" -> emit /\ \E r \in ready : \E p \in emitted(r) : LenOf(r, p) > Budget
             [] k = "zeros" -> emit /\ \E r \in ready : \E p \in emitted(r) : LenOf(r, p) = 0
             \* the shared tail: the gather deals pool views
             [] k = "claims" -> pc' > pc
             \* non-join: the quota is reached before the round's last step
             [] k = "quotacut" -> emit /\ ~JoinMode /\ done'
                                  /\ consumed' < consumed + SumSeq([r \in Ranks |-> Cardinality(emitted(r))]))]

SimInit == Init /\ cov = [k \in CovKeys |-> 0]

SimNext ==
    \/ \E r \in Ranks : Fetch(r) /\ UNCHANGED cov
    \* one random in-flight sample arrives (RandomElement: the simulator would otherwise
    \* generate, and check, one successor per in-flight sample at every step)
    \/ \E r \in Ranks : Q[r] # {} /\ \E p \in {RandomElement(Q[r])} : Drain(r, p) /\ UNCHANGED cov
    \/ /\ Gather
       /\ GatherCov
       /\ Assert(WouldSkip <=> (~IterationEnds /\ rounds' = rounds), "Progress.tla's plan disagrees with the gather")
       /\ (done' => PrintT(<<"ODB-REACH", cov', TLCGet("level") + 1>>))

\* Every behaviour reaches done within MaxLevel states (TLC's -depth).
ReachedDone == done \/ TLCGet("level") < MaxLevel

=============================================================================
