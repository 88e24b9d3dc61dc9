-- Makes the claim (and the release) a HOT update: the row's new version is
-- written on its own page and no index gains an entry. The claim sets only
-- claimed_at and claimed_by; event_outbox_lease_idx (20260518000000, the
-- ADR's #478 index) was the only index naming either, and no statement uses
-- it: the claim walks event_outbox_claim_idx in (enqueued_at, id) order
-- (ARCHITECTURE.md, "The claim query and its indexes"). A claim takes every
-- pending row of a page at once, so a page keeps room for a second version of
-- each (fill factor 50; measured: at 70 a third of a batch's rows did not fit
-- and were not HOT). It applies to pages written from now on.
DROP INDEX IF EXISTS event_outbox_lease_idx;
ALTER TABLE event_outbox SET (fillfactor = 50);
