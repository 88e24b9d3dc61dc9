-- Stats task (#1230): pending and parked counts, oldest pending age, and
-- (issue 27) how many pending rows wait behind a parked row of their
-- ordering key: they cannot be claimed until it is unparked or skipped.
-- Parked rows are few; each key that has one is one probe of
-- event_outbox_key_head_idx.
SELECT
    count(*) FILTER (WHERE parked_at IS NULL) AS pending,
    count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked,
    COALESCE(
        EXTRACT(EPOCH FROM now() - min(enqueued_at) FILTER (WHERE parked_at IS NULL)),
        0
    )::float8 AS oldest_age_secs,
    (SELECT count(*)
     FROM event_outbox b
     WHERE b.published_at IS NULL
       AND b.parked_at IS NULL
       AND b.ordering_key IS NOT NULL
       AND EXISTS (
           SELECT 1 FROM event_outbox h
           WHERE h.ordering_key COLLATE "C" = b.ordering_key COLLATE "C"
             AND h.key_seq < b.key_seq
             AND h.published_at IS NULL
             AND h.parked_at IS NOT NULL
             AND h.ordering_key IS NOT NULL
       )) AS blocked
FROM event_outbox
WHERE published_at IS NULL
