-- Subscriber step 2, right after the inbox row is inserted or locked: the
-- point a failed handler's work is rolled back to, keeping the row and its
-- lock (see inbox_record_failure.sql).
SAVEPOINT canopy_handler
