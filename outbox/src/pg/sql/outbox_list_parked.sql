-- Parked rows, oldest parked first. $1 limit; $2 and $3 the row to start
-- after (parked_at, id; NULL: from the first). With the envelope the
-- drainer publishes (a row written before the envelope column: its payload).
SELECT id, routing_key, attempts, last_error, enqueued_at, parked_at, ordering_key, key_seq,
       COALESCE(envelope, payload::text) AS envelope
FROM event_outbox
WHERE published_at IS NULL AND parked_at IS NOT NULL
  AND ($2::timestamptz IS NULL OR (parked_at, id) > ($2, $3::uuid))
ORDER BY parked_at, id
LIMIT $1
