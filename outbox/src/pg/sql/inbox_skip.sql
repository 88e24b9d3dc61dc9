-- Operators (issue 27): skip dead-lettered rows: marked processed without
-- their effect, skipped_at saying so, so that their keys' held rows can go
-- on. Only unprocessed dead-lettered rows. $1 subscription, $2 ids.
UPDATE event_inbox
SET processed_at = now(),
    skipped_at = now()
WHERE subscription = $1
  AND event_id = ANY($2)
  AND processed_at IS NULL
  AND dead_lettered_at IS NOT NULL
RETURNING event_id, subscription, routing_key, payload::text AS payload,
          attempts, last_error, received_at, dead_lettered_at,
          ordering_key, key_seq, held_at IS NOT NULL AS held
