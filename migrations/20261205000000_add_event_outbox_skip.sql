-- Ordering keys (issue 27): an operator may skip a parked row instead of
-- unparking it. A skipped row is never published: it is marked as if it
-- were (published_at, so the claim, the pending gauges and the janitor
-- treat it as done and its key's later events go on), and skipped_at says
-- it was not. Adding a nullable column without a default rewrites nothing.
ALTER TABLE event_outbox
    ADD COLUMN skipped_at TIMESTAMPTZ NULL;
