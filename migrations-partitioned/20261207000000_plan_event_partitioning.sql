-- Partitioned retention, opt-in (issue 28), step 1 of 4. The plain layout
-- (../migrations, the ADR's files) stays the default; a service that
-- chooses this layout runs these files after those (outbox::partitioned_migrator).
--
-- event_outbox and event_inbox become tables partitioned by RANGE of their
-- UUID v7 ids (whose first 48 bits are the writer's clock in ms), one
-- partition per `width_secs` (a day unless the session that runs this file
-- set canopy.partition_width_secs). The janitor creates partitions `ahead`
-- widths ahead and drops a partition whole once every row in it is
-- published (processed) and past retention.
--
-- The table as it is becomes the first partition, holding every id below
-- `cut_ms`, at least one width from now. This file bounds it there with a
-- CHECK that is NOT VALID (no scan, a brief lock); the next file validates
-- it without blocking writers; the third swaps the tables, and the check
-- lets PostgreSQL attach the old table without scanning it. Forward-only.
CREATE TABLE event_partitioning (
    parent TEXT PRIMARY KEY CHECK (parent IN ('event_outbox', 'event_inbox')),
    width_secs BIGINT NOT NULL CHECK (width_secs > 0),
    ahead INT NOT NULL CHECK (ahead BETWEEN 1 AND 90),
    cut_ms BIGINT NOT NULL
);

DO $$
DECLARE
    width_ms BIGINT := 1000 * coalesce(
        nullif(current_setting('canopy.partition_width_secs', true), ''), '86400')::BIGINT;
    now_ms BIGINT := floor(extract(epoch FROM clock_timestamp()) * 1000)::BIGINT;
    cut_ms BIGINT := (now_ms / width_ms + 2) * width_ms;
    cut UUID := (lpad(to_hex(cut_ms), 12, '0') || repeat('0', 20))::UUID;
BEGIN
    INSERT INTO event_partitioning (parent, width_secs, ahead, cut_ms)
    VALUES ('event_outbox', width_ms / 1000, 3, cut_ms),
           ('event_inbox', width_ms / 1000, 3, cut_ms);
    EXECUTE format('ALTER TABLE event_outbox ADD CONSTRAINT event_outbox_below_cut '
                   'CHECK (id < %L) NOT VALID', cut);
    EXECUTE format('ALTER TABLE event_inbox ADD CONSTRAINT event_inbox_below_cut '
                   'CHECK (event_id < %L) NOT VALID', cut);
END $$;
