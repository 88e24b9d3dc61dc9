-- no-transaction
-- Ordering keys (issue 27): event_outbox_claim_unkeyed_idx (previous
-- migration) and event_outbox_key_head_idx do its work now; no statement
-- uses it, and every write would keep paying for it.
DROP INDEX CONCURRENTLY IF EXISTS event_outbox_claim_idx;
