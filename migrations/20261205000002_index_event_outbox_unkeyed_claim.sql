-- no-transaction
-- Ordering keys (issue 27): the claim walks unkeyed rows in age order
-- through this index, and finds keyed rows through event_outbox_key_head_idx
-- instead, one per key. With keyed rows in the walk, a key's backlog (every
-- row but its head is unclaimable) would be stepped over on every claim:
-- measured 1.5 s per claim behind 100 000 rows of one key. It replaces
-- event_outbox_claim_idx (dropped by the next migration), so a write still
-- touches one claim index. Built CONCURRENTLY, as the previous migration
-- (same recovery if the build fails: DROP INDEX CONCURRENTLY
-- event_outbox_claim_unkeyed_idx, and run the migrations again).
CREATE INDEX CONCURRENTLY event_outbox_claim_unkeyed_idx
    ON event_outbox (enqueued_at, id)
    WHERE published_at IS NULL AND parked_at IS NULL AND ordering_key IS NULL;
