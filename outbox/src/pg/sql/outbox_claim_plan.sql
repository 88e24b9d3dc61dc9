-- Sent before outbox_claim.sql, in the same short transaction. A queue table
-- churns faster than autoanalyze: with statistics taken while the backlog was
-- empty the planner estimates one candidate row and picks a bitmap scan plus
-- a sort of the whole backlog (measured: 50-80 ms per claim at 100k pending
-- rows, growing with the backlog). These settings leave it only the ordered
-- walk of event_outbox_claim_idx, which stops after one batch. The disabled
-- sort inflates cost estimates past jit_above_cost, so JIT goes off too.
SET LOCAL enable_seqscan = off;
SET LOCAL enable_bitmapscan = off;
SET LOCAL enable_sort = off;
SET LOCAL jit = off;
