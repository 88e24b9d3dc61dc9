-- Partitioned retention (issue 28), step 4 of 4: event_inbox becomes a
-- table partitioned by RANGE (event_id), as event_outbox in step 3: the
-- table as it was is renamed event_inbox_p_first and attached below the
-- cut without a scan; partitions ahead; a DEFAULT partition. The primary
-- key (subscription, event_id) holds the partition key, so the inbox's
-- dedup stays one unique index probe. Forward-only.
ALTER TABLE event_inbox RENAME TO event_inbox_p_first;

DO $$
DECLARE
    idx TEXT;
BEGIN
    FOR idx IN
        SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE i.indrelid = 'event_inbox_p_first'::regclass
    LOOP
        EXECUTE format('ALTER INDEX %I RENAME TO %I', idx,
                       'event_inbox_p_first' || substr(idx, length('event_inbox') + 1));
    END LOOP;
END $$;

CREATE TABLE event_inbox (
    LIKE event_inbox_p_first INCLUDING DEFAULTS INCLUDING CONSTRAINTS
) PARTITION BY RANGE (event_id);
ALTER TABLE event_inbox DROP CONSTRAINT event_inbox_below_cut;

ALTER TABLE event_inbox ADD PRIMARY KEY (subscription, event_id);
CREATE INDEX event_inbox_processed_idx
    ON event_inbox (processed_at)
    WHERE processed_at IS NOT NULL;
CREATE INDEX event_inbox_unprocessed_idx
    ON event_inbox (received_at, event_id)
    WHERE processed_at IS NULL;
CREATE INDEX event_inbox_key_wait_idx
    ON event_inbox (subscription, ordering_key COLLATE "C", key_seq)
    WHERE processed_at IS NULL AND ordering_key IS NOT NULL;

DO $$
DECLARE
    p event_partitioning%ROWTYPE;
    lo BIGINT;
BEGIN
    SELECT * INTO STRICT p FROM event_partitioning WHERE parent = 'event_inbox';
    EXECUTE format('ALTER TABLE event_inbox ATTACH PARTITION event_inbox_p_first '
                   'FOR VALUES FROM (MINVALUE) TO (%L)',
                   (lpad(to_hex(p.cut_ms), 12, '0') || repeat('0', 20))::UUID);
    FOR i IN 0 .. p.ahead - 1 LOOP
        lo := p.cut_ms + i * p.width_secs * 1000;
        EXECUTE format('CREATE TABLE %I PARTITION OF event_inbox FOR VALUES FROM (%L) TO (%L)',
                       'event_inbox_p' || to_char(to_timestamp(lo / 1000.0) AT TIME ZONE 'UTC',
                                                  'YYYYMMDD"t"HH24MISS'),
                       (lpad(to_hex(lo), 12, '0') || repeat('0', 20))::UUID,
                       (lpad(to_hex(lo + p.width_secs * 1000), 12, '0') || repeat('0', 20))::UUID);
    END LOOP;
END $$;

CREATE TABLE event_inbox_p_default PARTITION OF event_inbox DEFAULT;
