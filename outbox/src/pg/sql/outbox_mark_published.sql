-- Phase 3 (#478): mark confirmed rows, only those still claimed by us.
-- $1 replica id, $2 row ids.
UPDATE event_outbox
SET published_at = now()
WHERE id = ANY($2)
  AND claimed_by = $1
  AND published_at IS NULL
