-- Sent before outbox_claim.sql (and outbox_key_window.sql), in the same short transaction. A queue table
-- churns faster than autoanalyze: with statistics taken while the backlog was
-- empty the planner estimates one candidate row and picks a bitmap scan plus
-- a sort of the whole backlog (measured: 50-80 ms per claim at 100k pending
-- rows, growing with the backlog). These settings leave it only the ordered
-- walk of event_outbox_claim_idx, which stops after one batch. The disabled
-- sort inflates cost estimates past jit_above_cost, so JIT goes off too.
--
-- If the drainer vanishes between the claim and its COMMIT (process killed,
-- network partition without a reset), PostgreSQL would keep the claimed rows
-- locked, and SKIP LOCKED would hide them from every other drainer, until
-- TCP keepalive noticed the dead peer (hours by default). The idle timeout
-- ends such a session, rolling the claim back. Found by the simulation
-- (db_outage, seed 2).
SET LOCAL idle_in_transaction_session_timeout = '10s';
SET LOCAL enable_seqscan = off;
SET LOCAL enable_bitmapscan = off;
SET LOCAL enable_sort = off;
SET LOCAL jit = off;
