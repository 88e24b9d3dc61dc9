-- ADR-018 note #1230: poison rows park after CANOPY_MQ_DRAINER_MAX_ATTEMPTS
-- row-culpable failures and stay parked until an operator unparks them.
-- Forward-only.
ALTER TABLE event_outbox
    ADD COLUMN parked_at TIMESTAMPTZ NULL;

-- The claim query walks this index in (enqueued_at, id) order and stops after
-- a batch: its cost depends on the batch size and the number of live leases,
-- not on the backlog. Parked rows are outside the predicate, so poison rows
-- never sit at the head of every claim scan.
CREATE INDEX event_outbox_claim_idx
    ON event_outbox (enqueued_at, id)
    WHERE published_at IS NULL AND parked_at IS NULL;

-- Parked-row listing, counting and unpark.
CREATE INDEX event_outbox_parked_idx
    ON event_outbox (parked_at)
    WHERE published_at IS NULL AND parked_at IS NOT NULL;

-- Retention sweep: the janitor deletes the oldest published rows in bounded
-- batches; without this index every batch would rescan the table.
CREATE INDEX event_outbox_published_idx
    ON event_outbox (published_at)
    WHERE published_at IS NOT NULL;
