-- Subscriber step 4 on failure: undo the handler's work (an aborted
-- transaction included), keep the inbox row and its lock.
ROLLBACK TO SAVEPOINT canopy_handler
