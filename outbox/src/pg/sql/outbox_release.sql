-- Infra failure (#1061): release our claims without touching attempts.
-- $1 replica id, $2 row ids.
UPDATE event_outbox
SET claimed_at = NULL, claimed_by = NULL
WHERE id = ANY($2)
  AND claimed_by = $1
  AND published_at IS NULL
