-- Parked rows, oldest parked first. $1 limit. With the envelope the
-- drainer publishes (a row written before the envelope column: its payload).
SELECT id, routing_key, attempts, last_error, enqueued_at, parked_at, ordering_key, key_seq,
       COALESCE(envelope, payload::text) AS envelope
FROM event_outbox
WHERE published_at IS NULL AND parked_at IS NOT NULL
ORDER BY parked_at, id
LIMIT $1
