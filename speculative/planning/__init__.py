"""How deep each sequence drafts, and one round's steps: the depth controller's knobs and its per-sequence
rule, the planner's rows (`rows.DraftRow`, one per sequence), the load planner over them and the measured
costs (`plan_depths`), the costs it learns, the round (plan, propose, verify, settle) that the in-process
decoder and the router's lanes share, round ahead's requests, and the sequence state a round updates
(written only through `SequenceStats`'s methods).

May import: `speculative.rules`, `speculative.drafters` (prompt lookup and the drafter interface).
"""
