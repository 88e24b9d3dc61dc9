-- Parked rows, oldest parked first. $1 limit.
SELECT id, routing_key, attempts, last_error, enqueued_at, parked_at, ordering_key, key_seq
FROM event_outbox
WHERE published_at IS NULL AND parked_at IS NOT NULL
ORDER BY parked_at, id
LIMIT $1
