-- publish_tx: one envelope in the caller's transaction. $1 id, $2 routing
-- key, $3 encoded envelope (kept as written in envelope, and as jsonb in
-- payload). The NOTIFY is delivered at COMMIT (never for a
-- rolled-back transaction) and wakes a listening drainer; the drainer's
-- polling remains the fallback.
WITH inserted AS (
    INSERT INTO event_outbox (id, routing_key, payload, envelope)
    VALUES ($1, $2, $3::jsonb, $3)
    RETURNING 1
)
SELECT pg_notify('canopy_outbox', '') FROM (SELECT 1 FROM inserted LIMIT 1) AS one
