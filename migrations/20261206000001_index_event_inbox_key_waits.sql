-- no-transaction
-- Ordering keys, the subscriber's half (issue 27): finds a key's
-- unprocessed rows with a lower number than a delivery's (one probe per
-- keyed delivery of an ordered subscription), and a key's held rows in
-- number order when its head is replayed or skipped. Only unprocessed
-- keyed rows are in it: it stays as small as the backlog of failures.
-- Built CONCURRENTLY (hence outside a transaction, and alone in its file)
-- so that a live event_inbox takes writes while it is built. A build that
-- fails leaves an INVALID index and the migration unrecorded: `DROP INDEX
-- CONCURRENTLY event_inbox_key_wait_idx`, then run the migrations again.
CREATE INDEX CONCURRENTLY event_inbox_key_wait_idx
    ON event_inbox (subscription, ordering_key COLLATE "C", key_seq)
    WHERE processed_at IS NULL AND ordering_key IS NOT NULL;
