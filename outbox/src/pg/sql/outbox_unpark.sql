-- Unpark (#1230, #433 admin surface): a fresh attempts budget and no lease.
-- last_error is kept as history. $1 ids, or NULL for every parked row.
UPDATE event_outbox
SET parked_at = NULL, attempts = 0, claimed_at = NULL, claimed_by = NULL
WHERE published_at IS NULL
  AND parked_at IS NOT NULL
  AND ($1::uuid[] IS NULL OR id = ANY($1))
