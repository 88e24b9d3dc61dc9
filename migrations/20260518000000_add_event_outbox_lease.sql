-- ADR-018 amendment #478: lease-based drainer. Forward-only.
ALTER TABLE event_outbox
    ADD COLUMN claimed_at TIMESTAMPTZ NULL,
    ADD COLUMN claimed_by TEXT NULL;

CREATE INDEX event_outbox_lease_idx
    ON event_outbox (claimed_at NULLS FIRST, enqueued_at)
    WHERE published_at IS NULL;
