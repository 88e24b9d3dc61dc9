-- Phase 1 (#478): claim up to $3 rows, stamping the lease. Walks
-- event_outbox_claim_idx in (enqueued_at, id) order; rows under a live lease
-- are filtered, rows locked by a concurrent claim or mark are skipped. Never
-- touches attempts. $1 replica id, $2 lease TTL in seconds, $3 batch size.
-- Also returns the trace context the row was written under (its envelope's
-- headers) and its age, where the commit-to-confirm lag starts. The body is
-- the envelope as written (jsonb's rendering only for rows written before
-- the envelope column existed).
WITH candidates AS (
    SELECT id
    FROM event_outbox
    WHERE published_at IS NULL
      AND parked_at IS NULL
      AND (claimed_at IS NULL OR claimed_at < now() - make_interval(secs => $2))
    ORDER BY enqueued_at, id
    LIMIT $3
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE event_outbox o
    SET claimed_at = now(), claimed_by = $1
    FROM candidates c
    WHERE o.id = c.id
    RETURNING o.id, o.routing_key, coalesce(o.envelope, o.payload::text) AS body, o.attempts, o.enqueued_at,
        o.payload->'headers'->>'traceparent' AS traceparent,
        o.payload->'headers'->>'tracestate' AS tracestate
)
SELECT id, routing_key, body, attempts, traceparent, tracestate,
    greatest(extract(epoch FROM clock_timestamp() - enqueued_at), 0)::float8 AS age_secs
FROM claimed
ORDER BY enqueued_at, id
