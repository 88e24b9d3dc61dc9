-- Replay and operators: unprocessed rows, oldest first, filtered.
-- $1 ids (NULL: any), $2 subscription (NULL: any), $3 routing key
-- (NULL: any), $4 dead-lettered only, $5 limit, $6 and $7 the row to start
-- after (received_at, event_id; NULL: from the first).
SELECT event_id, subscription, routing_key, payload::text AS payload,
       attempts, last_error, received_at, dead_lettered_at,
       ordering_key, key_seq, held_at IS NOT NULL AS held
FROM event_inbox
WHERE processed_at IS NULL
  AND ($1::uuid[] IS NULL OR event_id = ANY($1))
  AND ($2::text IS NULL OR subscription = $2)
  AND ($3::text IS NULL OR routing_key = $3)
  AND (NOT $4 OR dead_lettered_at IS NOT NULL)
  AND ($6::timestamptz IS NULL OR (received_at, event_id) > ($6, $7::uuid))
ORDER BY received_at, event_id
LIMIT $5
