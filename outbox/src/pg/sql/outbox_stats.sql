-- Stats task (#1230): pending and parked counts, oldest pending age.
SELECT
    count(*) FILTER (WHERE parked_at IS NULL) AS pending,
    count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked,
    COALESCE(
        EXTRACT(EPOCH FROM now() - min(enqueued_at) FILTER (WHERE parked_at IS NULL)),
        0
    )::float8 AS oldest_age_secs
FROM event_outbox
WHERE published_at IS NULL
