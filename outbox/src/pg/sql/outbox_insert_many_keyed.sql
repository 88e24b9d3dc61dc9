-- publish_many_tx of a batch holding ordering keys: $1 ids, $2 routing
-- keys, $3 encoded envelopes, $4 ordering keys (NULL for unkeyed envelopes),
-- same order. Each key's numbers are taken at once (its count in the
-- batch) under its row lock, keys in sorted order (two batches sharing keys
-- lock them in one order), and given to its envelopes in batch order.
WITH batch AS (
    SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[])
        WITH ORDINALITY AS t(id, routing_key, body, okey, ord)
), counts AS (
    SELECT okey, count(*) AS n FROM batch WHERE okey IS NOT NULL GROUP BY okey
), seqs AS (
    INSERT INTO event_outbox_key AS k (ordering_key, last_seq)
    SELECT okey, n FROM counts ORDER BY okey
    ON CONFLICT (ordering_key) DO UPDATE SET last_seq = k.last_seq + excluded.last_seq
    RETURNING k.ordering_key, k.last_seq
), numbered AS (
    SELECT b.id, b.routing_key, b.body, b.okey, b.ord,
        s.last_seq - c.n + row_number() OVER (PARTITION BY b.okey ORDER BY b.ord) AS key_seq
    FROM batch b
    LEFT JOIN seqs s ON s.ordering_key = b.okey
    LEFT JOIN counts c ON c.okey = b.okey
), inserted AS (
    INSERT INTO event_outbox (id, routing_key, payload, envelope, ordering_key, key_seq)
    SELECT id, routing_key, body::jsonb, body, okey, CASE WHEN okey IS NULL THEN NULL ELSE key_seq END
    FROM numbered
    ORDER BY ord
    RETURNING 1
)
SELECT pg_notify('canopy_outbox', '') FROM (SELECT 1 FROM inserted LIMIT 1) AS one
