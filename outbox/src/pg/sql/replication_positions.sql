-- The durability gates (outbox::core::durability): the primary's WAL flush
-- position, and for each standby named in $1 (application_names, in order)
-- how many WAL senders stream to it and the furthest it has flushed (NULL
-- to a role that may not read pg_stat_replication's positions). On a
-- standby, pg_current_wal_flush_lsn() fails: "recovery is in progress".
-- The timeline is the first eight hex digits of the WAL file's name.
SELECT (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::text AS flushed,
       ('x' || substr(pg_walfile_name(pg_current_wal_flush_lsn()), 1, 8))::bit(32)::int8
           AS timeline,
       count(r.pid) AS streams,
       (max(r.flush_lsn) - '0/0'::pg_lsn)::text AS standby_flushed
FROM unnest($1::text[]) WITH ORDINALITY AS n(name, ord)
LEFT JOIN pg_stat_replication r ON r.application_name = n.name
GROUP BY n.ord
ORDER BY n.ord
