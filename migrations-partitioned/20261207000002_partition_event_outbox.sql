-- Partitioned retention (issue 28), step 3 of 4: event_outbox becomes a
-- table partitioned by RANGE (id). The table as it was is renamed
-- event_outbox_p_first (its indexes likewise) and attached as the
-- partition of every id below the cut; its validated CHECK spares the
-- scan, so this file holds its locks for milliseconds whatever the
-- table's size. New partitions are created `ahead` widths ahead of the
-- cut, and a DEFAULT partition takes any id no partition covers (an id
-- from a clock far off, or a range the janitor has not created yet): a
-- write never fails for want of a partition. Each partition has the
-- plain layout's indexes and fill factor; every statement of the library
-- runs unchanged on the parent. Forward-only.
ALTER TABLE event_outbox RENAME TO event_outbox_p_first;

DO $$
DECLARE
    idx TEXT;
BEGIN
    FOR idx IN
        SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE i.indrelid = 'event_outbox_p_first'::regclass
    LOOP
        EXECUTE format('ALTER INDEX %I RENAME TO %I', idx,
                       'event_outbox_p_first' || substr(idx, length('event_outbox') + 1));
    END LOOP;
END $$;

CREATE TABLE event_outbox (
    LIKE event_outbox_p_first INCLUDING DEFAULTS INCLUDING CONSTRAINTS
) PARTITION BY RANGE (id);
ALTER TABLE event_outbox DROP CONSTRAINT event_outbox_below_cut;

ALTER TABLE event_outbox ADD PRIMARY KEY (id);
CREATE INDEX event_outbox_unpublished_idx
    ON event_outbox (enqueued_at)
    WHERE published_at IS NULL;
CREATE INDEX event_outbox_parked_idx
    ON event_outbox (parked_at)
    WHERE published_at IS NULL AND parked_at IS NOT NULL;
CREATE INDEX event_outbox_published_idx
    ON event_outbox (published_at)
    WHERE published_at IS NOT NULL;
CREATE INDEX event_outbox_key_head_idx
    ON event_outbox (ordering_key COLLATE "C", key_seq)
    WHERE published_at IS NULL AND ordering_key IS NOT NULL;
CREATE INDEX event_outbox_claim_unkeyed_idx
    ON event_outbox (enqueued_at, id)
    WHERE published_at IS NULL AND parked_at IS NULL AND ordering_key IS NULL;

DO $$
DECLARE
    p event_partitioning%ROWTYPE;
    lo BIGINT;
BEGIN
    SELECT * INTO STRICT p FROM event_partitioning WHERE parent = 'event_outbox';
    EXECUTE format('ALTER TABLE event_outbox ATTACH PARTITION event_outbox_p_first '
                   'FOR VALUES FROM (MINVALUE) TO (%L)',
                   (lpad(to_hex(p.cut_ms), 12, '0') || repeat('0', 20))::UUID);
    FOR i IN 0 .. p.ahead - 1 LOOP
        lo := p.cut_ms + i * p.width_secs * 1000;
        EXECUTE format('CREATE TABLE %I PARTITION OF event_outbox FOR VALUES FROM (%L) TO (%L) '
                       'WITH (fillfactor = 50)',
                       'event_outbox_p' || to_char(to_timestamp(lo / 1000.0) AT TIME ZONE 'UTC',
                                                   'YYYYMMDD"t"HH24MISS'),
                       (lpad(to_hex(lo), 12, '0') || repeat('0', 20))::UUID,
                       (lpad(to_hex(lo + p.width_secs * 1000), 12, '0') || repeat('0', 20))::UUID);
    END LOOP;
END $$;

CREATE TABLE event_outbox_p_default PARTITION OF event_outbox DEFAULT
    WITH (fillfactor = 50);
