-- publish_tx of an envelope with an ordering key: $1 id, $2 routing key,
-- $3 encoded envelope, $4 ordering key. The key's next number comes from
-- event_outbox_key under its row lock, held until COMMIT, so numbers follow
-- commit order (see the migration 20261204000000). The NOTIFY as in
-- outbox_insert.sql.
WITH seq AS (
    INSERT INTO event_outbox_key AS k (ordering_key, last_seq)
    VALUES ($4, 1)
    ON CONFLICT (ordering_key) DO UPDATE SET last_seq = k.last_seq + 1
    RETURNING k.last_seq
), inserted AS (
    INSERT INTO event_outbox (id, routing_key, payload, envelope, ordering_key, key_seq)
    SELECT $1, $2, $3::jsonb, $3, $4, seq.last_seq FROM seq
    RETURNING 1
)
SELECT pg_notify('canopy_outbox', '') FROM (SELECT 1 FROM inserted LIMIT 1) AS one
