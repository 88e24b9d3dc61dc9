-- Partitioned retention (issue 28), step 2 of 4: proves every row written
-- so far lies below the cut. VALIDATE scans the table under a SHARE UPDATE
-- EXCLUSIVE lock: writers and the drainer go on while it runs. It fails,
-- naming the constraint, if a row's id is at or above the cut (an id that
-- is not a UUID v7 of a past instant, written outside publish_tx): move or
-- delete that row, then run the migrations again.
ALTER TABLE event_outbox VALIDATE CONSTRAINT event_outbox_below_cut;
ALTER TABLE event_inbox VALIDATE CONSTRAINT event_inbox_below_cut;
