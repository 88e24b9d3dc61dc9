-- no-transaction
-- Ordering keys (issue 27): finds each key's head, the lowest-numbered
-- unpublished row of the key. The drainer steps from key to key through it
-- (one probe per key, so a key's backlog costs nothing: `outbox_key_window.sql`),
-- and the claim checks with one probe that a keyed row is its key's head.
-- Parked rows stay in it: a parked head holds back its key. Keys compare
-- as bytes (COLLATE "C"): cheaper than the database's collation, and the
-- drainer's resume point means the same thing on every server.
-- Built CONCURRENTLY (hence outside a transaction, and alone in its file)
-- so that a live event_outbox takes writes while it is built. A build that
-- fails leaves an INVALID index and the migration unrecorded: `DROP INDEX
-- CONCURRENTLY event_outbox_key_head_idx`, then run the migrations again.
CREATE INDEX CONCURRENTLY event_outbox_key_head_idx
    ON event_outbox (ordering_key COLLATE "C", key_seq)
    WHERE published_at IS NULL AND ordering_key IS NOT NULL;
