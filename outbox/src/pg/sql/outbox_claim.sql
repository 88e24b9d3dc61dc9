-- Phase 1 (#478): claim up to $3 rows, stamping the lease. $1 replica id,
-- $2 lease TTL in seconds, $3 batch size, $4 keyed candidates (issue 27:
-- heads found by outbox_key_window.sql). Never touches attempts.
-- Unkeyed rows: walks event_outbox_claim_unkeyed_idx in (enqueued_at, id)
-- order; rows under a live lease are filtered, rows locked by a concurrent
-- claim or mark are skipped.
-- Keyed rows: only the candidates, and each only if it is still its key's
-- head: no row of its key with a lower number is unpublished, whether
-- leased, locked or parked (one probe of event_outbox_key_head_idx, read
-- whatever locks another claim holds). So a key has at most one row
-- claimed, the next only once this one is marked, and a parked head holds
-- back its key.
-- The walk's place (ClaimPosition): `sql::CLAIM_AFTER` is this statement
-- with unkeyed rows only past ($5 microseconds since the epoch, $6 id) in
-- (enqueued_at, id) order, an index condition of the walk, so a drain's
-- next claim skips the index entries of rows it has in flight and of rows
-- published since the last VACUUM (measured: a claim's index walk read 20
-- pages at the start of a 100 000-row backlog, 464 after 90 000 rows).
-- Each row's place comes back as `enqueued_us` (NULL for ±infinity; exact
-- on PostgreSQL 14+, whose extract() is numeric).
-- The oldest $3 of both, in (enqueued_at, id) order. Also returns the
-- trace context the row was written under (its envelope's headers), its
-- key and number, and its age, where the commit-to-confirm lag starts. The
-- body is the envelope as written (jsonb's rendering only for rows written
-- before the envelope column existed).
WITH unkeyed AS (
    SELECT o.id, o.ctid AS tid, o.enqueued_at
    FROM event_outbox o
    WHERE o.published_at IS NULL
      AND o.parked_at IS NULL
      AND o.ordering_key IS NULL
      AND (o.claimed_at IS NULL OR o.claimed_at < now() - make_interval(secs => $2))
      -- [past the walk's place]
    ORDER BY o.enqueued_at, o.id
    LIMIT $3
    FOR UPDATE OF o SKIP LOCKED
), keyed AS (
    SELECT o.id, o.ctid AS tid, o.enqueued_at
    FROM unnest($4::uuid[]) AS c(id)
    JOIN event_outbox o ON o.id = c.id
    WHERE o.published_at IS NULL
      AND o.parked_at IS NULL
      AND o.ordering_key IS NOT NULL
      AND (o.claimed_at IS NULL OR o.claimed_at < now() - make_interval(secs => $2))
      AND NOT EXISTS (
          SELECT 1
          FROM event_outbox e
          WHERE e.ordering_key COLLATE "C" = o.ordering_key COLLATE "C"
            AND e.key_seq < o.key_seq
            AND e.published_at IS NULL
            AND e.ordering_key IS NOT NULL
      )
    -- Each candidate (a window's heads, at most a batch) is found by its
    -- primary key, from the list, with no ORDER BY or LIMIT here: written
    -- as `id = ANY($4) ORDER BY enqueued_at`, the planner, sorts disabled,
    -- walked an age-ordered index and filtered it for the candidates
    -- (185 ms a claim at 700k rows; the harness found it).
    FOR UPDATE OF o SKIP LOCKED
), candidates AS (
    SELECT id, tid FROM (SELECT * FROM unkeyed UNION ALL SELECT * FROM keyed) c
    ORDER BY enqueued_at, id
    LIMIT $3
), claimed AS (
    UPDATE event_outbox o
    SET claimed_at = now(), claimed_by = $1
    FROM candidates c
    -- The row version the lock took, by its address (a TID scan): found
    -- again through the primary key it cost each row a descent of the
    -- index, 4 of the 8 buffers a claimed row read. The id stays in the
    -- join: a partitioned table's address is only unique within its
    -- partition (the id picks the partition), and an address that holds
    -- another row by now matches nothing (the row is not claimed).
    WHERE o.id = c.id AND o.ctid = c.tid
    RETURNING o.id, o.routing_key, coalesce(o.envelope, o.payload::text) AS body, o.attempts, o.enqueued_at,
        o.ordering_key, o.key_seq,
        o.payload->'headers'->>'traceparent' AS traceparent,
        o.payload->'headers'->>'tracestate' AS tracestate
)
SELECT id, routing_key, body, attempts, ordering_key, key_seq, traceparent, tracestate,
    greatest(extract(epoch FROM clock_timestamp() - enqueued_at), 0)::float8 AS age_secs,
    CASE WHEN isfinite(enqueued_at)
        THEN (extract(epoch FROM enqueued_at) * 1000000)::bigint END AS enqueued_us
FROM claimed
ORDER BY enqueued_at, id
