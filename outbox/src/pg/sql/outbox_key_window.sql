-- Ordering keys (issue 27): the heads of up to $2 keys after $1 (in byte
-- order; '' for the first key), for the next claim to take. Steps from key
-- to key through event_outbox_key_head_idx: its first entry after a key is
-- the next key's head (the index is in (key, number) order), so a key
-- costs one probe whatever its backlog. $3 lease TTL in seconds. A head is
-- claimable if it is not parked and its lease is free or expired; the
-- claim checks again under the row lock.
WITH RECURSIVE heads AS (
    (SELECT e.ordering_key COLLATE "C" AS k, e.id, e.parked_at, e.claimed_at, 1 AS n
     FROM event_outbox e
     WHERE e.published_at IS NULL AND e.ordering_key IS NOT NULL
       AND e.ordering_key COLLATE "C" > $1
     ORDER BY e.ordering_key COLLATE "C", e.key_seq
     LIMIT 1)
    UNION ALL
    SELECT next.k, next.id, next.parked_at, next.claimed_at, heads.n + 1
    FROM heads
    CROSS JOIN LATERAL (
        SELECT e.ordering_key COLLATE "C" AS k, e.id, e.parked_at, e.claimed_at
        FROM event_outbox e
        WHERE e.published_at IS NULL AND e.ordering_key IS NOT NULL
          AND e.ordering_key COLLATE "C" > heads.k
        ORDER BY e.ordering_key COLLATE "C", e.key_seq
        LIMIT 1
    ) next
    WHERE heads.n < $2
)
SELECT k AS ordering_key, id,
    (parked_at IS NULL
     AND (claimed_at IS NULL OR claimed_at < now() - make_interval(secs => $3))) AS claimable
FROM heads
ORDER BY n
