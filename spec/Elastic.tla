------------------------------ MODULE Elastic ------------------------------
(***************************************************************************)
(* Elastic resume (odb_core/elastic.py): the rest of an epoch on W ranks,  *)
(* after a run on any number of ranks yielded the global positions         *)
(* Consumed of the epoch's global order 1..Len(GLen) (the padded           *)
(* DistributedSampler order: padding duplicates are positions of their     *)
(* own). The remaining positions, in global order, are dealt round-robin   *)
(* (assign_views): rank r's views are DealOp(r), their lengths GLen's. A   *)
(* configuration sets NV <- ElasticNV and Length <- ElasticLength, so ODB  *)
(* runs unchanged from that initial state; ResumeExactlyOnce checks the    *)
(* two runs together: every position of the epoch yielded exactly once.   *)
(***************************************************************************)
EXTENDS ODB

CONSTANTS GLen,     \* lengths of the epoch's global order
          Consumed  \* global positions the run before the resume yielded

ASSUME Consumed \subseteq 1..Len(GLen)

RECURSIVE UnyieldedFrom(_)
UnyieldedFrom(i) == IF i > Len(GLen) THEN <<>>
               ELSE IF i \in Consumed THEN UnyieldedFrom(i + 1) ELSE <<i>> \o UnyieldedFrom(i + 1)
Unyielded == UnyieldedFrom(1)

\* rank r takes Unyielded[r], Unyielded[r + W], ... (remaining[r - 1::W] in odb_core, 0-based)
DealFrom(rest, r) == [k \in 1..(IF Len(rest) >= r THEN (Len(rest) - r) \div W + 1 ELSE 0) |-> rest[r + (k - 1) * W]]
Deal(r) == DealFrom(Unyielded, r)
DealOp(r) == Deal(r)

ElasticNV == [r \in 1..W |-> Len(DealOp(r))]
ElasticLength == [r \in 1..W |-> [p \in 1..Len(DealOp(r)) |-> GLen[DealOp(r)[p]]]]

\* No position dealt twice (to one rank or to two) or dealt after being yielded; at the end,
\* the positions yielded before the resume and after it are the whole epoch (P4 across the resume).
ResumeExactlyOnce ==
    /\ \A r \in Ranks : Cardinality(Range(DealOp(r))) = Len(DealOp(r))
    /\ \A r, s \in Ranks : r # s => Range(DealOp(r)) \cap Range(DealOp(s)) = {}
    /\ \A r \in Ranks : Range(DealOp(r)) \cap Consumed = {}
    /\ done => Consumed \cup UNION {{DealOp(r)[p] : p \in E[r]} : r \in Ranks} = 1..Len(GLen)

\* The global positions a run on OW ranks yielded, from each rank's yielded sampler positions
\* cons[r] (rank r's p-th view, both 1-based, is global position r + (p - 1) * OW: the
\* DistributedSampler order): what merge_states computes from every rank's state_dict.
YieldedOf(cons, OW) == UNION {{r + (p - 1) * OW : p \in cons[r]} : r \in DOMAIN cons}

\* Model values: an epoch of 3 ranks x 3 views (8 samples; position 9 pads with position 1's
\* sample) resumed on 2 ranks; an epoch of 2 ranks x 4 views resumed on 3 ranks.
GLen_3x3 == <<2, 3, 6, 9, 1, 5, 12, 4, 2>>
Consumed_3x3 == {1, 2, 3, 5}
GLen_2x4 == <<2, 1, 3, 1, 6, 5, 9, 12>>
Consumed_2x4 == {1, 2, 4}

\* Seeded bug: the checkpoint takes a view that was fetched and buffered but not yet
\* yielded (the first remaining one) for consumed: it is dealt to no rank and lost.
MutDealForget(r) == DealFrom(Tail(Unyielded), r)
\* Seeded bug: rank 1's deal lists its first position twice (its sample would be trained twice;
\* NoLeak and JoinCoverage see two views, ResumeExactlyOnce's first clause the repeat).
MutDealTwice(r) == IF r = 1 /\ Deal(1) # <<>> THEN Deal(1) \o <<Deal(1)[1]>> ELSE Deal(r)
=============================================================================
