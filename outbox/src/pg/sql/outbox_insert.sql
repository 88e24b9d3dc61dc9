-- publish_tx: one envelope in the caller's transaction. $1 id, $2 routing
-- key, $3 encoded envelope.
INSERT INTO event_outbox (id, routing_key, payload)
VALUES ($1, $2, $3::jsonb)
