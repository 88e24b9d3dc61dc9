-- Ordering keys, the subscriber's half (issue 27): an ordered
-- subscription records each keyed delivery's key and number, so that a
-- delivery whose key has an earlier event still unprocessed waits for it.
-- held_at marks a row recorded, not applied, because an earlier event of
-- its key is dead-lettered (or held itself): replaying or skipping that
-- event releases it. skipped_at marks a dead-lettered row an operator
-- skipped: processed without its effect. Nullable columns without a
-- default rewrite nothing.
ALTER TABLE event_inbox
    ADD COLUMN ordering_key TEXT NULL,
    ADD COLUMN key_seq BIGINT NULL,
    ADD COLUMN held_at TIMESTAMPTZ NULL,
    ADD COLUMN skipped_at TIMESTAMPTZ NULL;
