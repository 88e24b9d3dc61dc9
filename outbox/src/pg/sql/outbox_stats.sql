-- Stats task (#1230): pending and parked counts, oldest pending age, and
-- (issue 27) how many pending rows wait behind a parked row of their
-- ordering key: they cannot be claimed until it is unparked or skipped.
-- That count starts from the parked rows (few, event_outbox_parked_idx),
-- one range of event_outbox_key_head_idx per key that has one.
SELECT
    count(*) FILTER (WHERE parked_at IS NULL) AS pending,
    count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked,
    COALESCE(
        EXTRACT(EPOCH FROM now() - min(enqueued_at) FILTER (WHERE parked_at IS NULL)),
        0
    )::float8 AS oldest_age_secs,
    (SELECT COALESCE(sum(behind.n), 0)::bigint
     FROM (
         SELECT p.ordering_key, min(p.key_seq) AS first_parked
         FROM event_outbox p
         WHERE p.published_at IS NULL
           AND p.parked_at IS NOT NULL
           AND p.ordering_key IS NOT NULL
         GROUP BY p.ordering_key
     ) held
     CROSS JOIN LATERAL (
         SELECT count(*) AS n
         FROM event_outbox b
         WHERE b.ordering_key COLLATE "C" = held.ordering_key COLLATE "C"
           AND b.key_seq > held.first_parked
           AND b.published_at IS NULL
           AND b.parked_at IS NULL
           AND b.ordering_key IS NOT NULL
     ) behind) AS blocked
FROM event_outbox
WHERE published_at IS NULL
