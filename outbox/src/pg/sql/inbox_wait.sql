-- Ordered subscriptions (issue 27), in the handler's transaction: a keyed
-- delivery behind an earlier event of its key that waits for its retry
-- goes back to the queue, and its row records that it waits too
-- (unprocessed, no attempt), so that whichever replica gets the key's
-- deliveries next, in whatever order the broker gives them back, holds a
-- later one behind it. An existing row is left as it is. $1 event id,
-- $2 subscription, $3 routing key, $4 encoded envelope, $5 ordering key,
-- $6 its number.
INSERT INTO event_inbox
    (event_id, subscription, routing_key, payload, ordering_key, key_seq)
VALUES ($1, $2, $3, $4::jsonb, $5, $6)
ON CONFLICT (subscription, event_id) DO NOTHING
