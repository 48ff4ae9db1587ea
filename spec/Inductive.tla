----------------------------- MODULE Inductive -----------------------------
(***************************************************************************)
(* Inductiveness of ODB's invariants on bounded domains.                   *)
(*                                                                         *)
(* The standard check: the initial predicate ranges over every state of a  *)
(* bounded domain that satisfies a candidate invariant Inv (IndInit ==      *)
(* Domain /\ Inv), the next-state relation is ODB's Next, and TLC checks    *)
(* Inv on every successor. If it holds, Inv is inductive on that domain:    *)
(* it holds from any state satisfying it, not only from the states that    *)
(* Init reaches. model_checks/inductive.py writes a module extending this   *)
(* one with the constants and the candidate (a conjunction of named        *)
(* predicates), and lists which candidates are inductive and which are     *)
(* not (with the one-step counterexample TLC prints).                      *)
(*                                                                         *)
(* The domain, per rank (DomainMode):                                      *)
(*  "free": next in 1..NV+1; Q, E, H any subsets of the views; B any       *)
(*          sequence of distinct views (TypeOK with B duplicate-free);     *)
(*  "partition": R, Q, B, E partition the views (NoLeak built in, so W = 2 *)
(*          stays small), H any subset of the views;                       *)
(*  "held": a partition with H a subset of B (HeldOK's first half built in).*)
(* A pool (the shared tail): pc in 0..Len(Pool), each claimed view owned  *)
(* by one rank, each rank's claims in increasing order (PoolOnce built in); *)
(* a rank's views are then its own and its claims (Views, NVr).            *)
(* A stream (StreamOn): next also NV+2 (the end known), the views fetched *)
(* being 1..NV then as at NV+1 (fetched up to the end, the end unknown).   *)
(* The rest: rounds in 0..SumSeq(NV) + pc; consumed in 0..Quota (non-join; 0 in *)
(* join mode); done = FALSE, lastStep = 0 and lastOut idle. Nothing reads  *)
(* lastOut (Lockstep, BudgetOK and WithinCapacity constrain the successor, *)
(* which does not depend on it) and nothing but QuotaClosure reads         *)
(* lastStep, and only once done; a done state is a fixed point of Next     *)
(* (only Terminating is enabled), so it satisfies Inv iff it is in it.     *)
(***************************************************************************)
EXTENDS Progress

CONSTANT DomainMode   \* "free", "partition" or "held" (partition with H a subset of B)

\* a stream's fetch skips claimed views (next jumps to NV + 2): no domain has both
ASSUME ~(StreamOn /\ Pool # <<>>)

Arrangements(S) == {f \in [1..Cardinality(S) -> S] : Range(f) = S}
RECURSIVE SeqsOf(_)
\* duplicate-free sequences over S
SeqsOf(S) == {<<>>} \cup UNION {{<<x>> \o s : s \in SeqsOf(S \ {x})} : x \in S}

\* next's range: past the end, and for a stream also the end known (NV + 2)
NextRange(r) == 1..(NVr(r) + IF StreamOn THEN 2 ELSE 1)

\* one rank's (next, Q, B, E, H)
LocalStates(r) ==
    IF DomainMode = "free"
    THEN {<<n, q, b, e, h>> : n \in NextRange(r), q \in SUBSET Views(r), b \in SeqsOf(Views(r)),
                              e \in SUBSET Views(r), h \in SUBSET Views(r)}
    ELSE UNION {LET fetched == 1..(IF n - 1 > NVr(r) THEN NVr(r) ELSE n - 1) IN
                UNION {UNION {{<<n, q, b, (fetched \ q) \ Range(b), h>>
                               : b \in Arrangements(bs), h \in SUBSET (IF DomainMode = "held" THEN bs ELSE Views(r))}
                              : bs \in SUBSET (fetched \ q)}
                       : q \in SUBSET fetched}
                : n \in NextRange(r)}

RECURSIVE Product(_)
Product(k) == IF k = 0 THEN {<<>>} ELSE {p \o <<x>> : p \in Product(k - 1), x \in LocalStates(k)}

Domain ==
    \* the shared tail (bound first: Views reads claimed): pc views claimed, each by one rank, in
    \* increasing order per rank (PoolOnce built in); with no pool, pc = 0 and no claims
    /\ pc \in 0..Len(Pool)
    /\ \E owner \in [1..pc -> Ranks] : claimed = [r \in Ranks |-> SelectSeq([i \in 1..pc |-> i], LAMBDA i : owner[i] = r)]
    /\ \E ls \in Product(W) :
        /\ next = [r \in Ranks |-> ls[r][1]]
        /\ Q = [r \in Ranks |-> ls[r][2]]
        /\ B = [r \in Ranks |-> ls[r][3]]
        /\ E = [r \in Ranks |-> ls[r][4]]
        /\ H = [r \in Ranks |-> ls[r][5]]
    /\ rounds \in 0..(SumSeq(NV) + pc)
    /\ consumed \in (IF JoinMode THEN {0} ELSE 0..Quota)
    /\ lastStep = 0
    /\ lastOut = [r \in Ranks |-> <<>>]
    /\ done = FALSE

---------------------------------------------------------------------------
(* Strengthening conjuncts: facts about reachable states that the         *)
(* invariants need to be inductive (each is itself checked, as part of the *)
(* candidate).                                                             *)

\* each emitting round emits at least one view, and E is empty before the first
RoundsEmitted ==
    LET emitted == SumSeq([r \in Ranks |-> Cardinality(E[r])])
    IN rounds <= emitted /\ (rounds = 0 => emitted = 0)

\* the trainer has not reached the quota while the run goes on; join mode consumes nothing
QuotaOpen ==
    IF JoinMode THEN consumed = 0 /\ lastStep = 0
    ELSE ~done => consumed < Quota

\* with regroup off nothing is ever held
HeldOnlyWithRegroup == RegroupDen = 0 => \A r \in Ranks : H[r] = {}

\* the invariants of ODB as one predicate
ODBInvariants ==
    /\ TypeOK /\ NoLeak /\ DepthBound /\ HeldOK /\ Lockstep /\ BudgetOK /\ WithinCapacity
    /\ JoinCoverage /\ QuotaClosure /\ RoundBound /\ BRuleAdmissible /\ PoolOnce /\ NoDupInRound
Strengthening == RoundsEmitted /\ QuotaOpen /\ HeldOnlyWithRegroup

\* The depth bound before holds were capped at D (for the record: not inductive).
OldDepthBound == \A r \in Ranks : Cardinality(Q[r]) + Len(B[r]) - Cardinality(H[r]) <= Depth
=============================================================================
