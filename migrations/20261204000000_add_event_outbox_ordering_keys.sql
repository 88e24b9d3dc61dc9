-- Ordering keys (issue 27): an event may carry an ordering key, and the
-- events of one key are numbered in the order their transactions commit.
-- publish_tx takes the next number from event_outbox_key under that row's
-- lock, held until COMMIT: a second transaction writing the same key waits
-- there until the first commits (its number then follows) or rolls back
-- (the number is given back). Unkeyed rows have neither column. Adding
-- nullable columns without a default rewrites nothing.
ALTER TABLE event_outbox
    ADD COLUMN ordering_key TEXT,
    ADD COLUMN key_seq BIGINT,
    ADD CONSTRAINT event_outbox_ordering_key_seq
        CHECK ((ordering_key IS NULL) = (key_seq IS NULL));

CREATE TABLE event_outbox_key (
    ordering_key TEXT PRIMARY KEY,
    last_seq BIGINT NOT NULL
);
