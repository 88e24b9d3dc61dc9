-- publish_many_tx: many envelopes in one round-trip, in the caller's
-- transaction. $1 ids, $2 routing keys, $3 encoded envelopes (same order).
-- One NOTIFY for the lot, delivered at COMMIT (see outbox_insert.sql).
WITH inserted AS (
    INSERT INTO event_outbox (id, routing_key, payload, envelope)
    SELECT id, routing_key, payload::jsonb, payload
    FROM unnest($1::uuid[], $2::text[], $3::text[]) AS t(id, routing_key, payload)
    RETURNING 1
)
SELECT pg_notify('canopy_outbox', '') FROM (SELECT 1 FROM inserted LIMIT 1) AS one
