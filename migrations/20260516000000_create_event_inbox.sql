-- ADR-018 amendment #433: the consumer-side inbox. One row per event a
-- subscriber of this service received; the primary key (the envelope's UUID
-- v7) makes redelivery idempotent. The row is written in the handler's
-- transaction (so it commits with the handler's effect) and its attempts are
-- bumped on a separate connection (so they survive the rollback of a failed
-- attempt). Forward-only.
CREATE TABLE event_inbox (
    event_id UUID PRIMARY KEY,
    subscription TEXT NOT NULL,
    routing_key TEXT NOT NULL,
    payload JSONB NOT NULL,
    received_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    processed_at TIMESTAMPTZ,
    attempts INT NOT NULL DEFAULT 0,
    last_error TEXT,
    dead_lettered_at TIMESTAMPTZ
);

-- Retention: the inbox janitor deletes the oldest processed rows in bounded
-- batches. Unprocessed rows are kept for replay.
CREATE INDEX event_inbox_processed_idx
    ON event_inbox (processed_at)
    WHERE processed_at IS NOT NULL;

-- Replay: operators list and select unprocessed rows, oldest first.
CREATE INDEX event_inbox_unprocessed_idx
    ON event_inbox (received_at, event_id)
    WHERE processed_at IS NULL;
