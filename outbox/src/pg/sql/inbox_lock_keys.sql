-- Ordered subscriptions (issue 27), first in a handler's transaction with
-- keyed deliveries, one round trip for all of them: take each key's lock
-- in this subscription until the transaction ends. Deliveries, replays and
-- skips of one key then decide one after the other, each seeing what the
-- last committed: a delivery recorded held behind a dead-lettered event
-- cannot commit after that event's replay or skip looked for the key's
-- held rows, which would leave it held for ever. A statement of its own,
-- so that inbox_try_insert_keyed.sql takes its snapshot after the waits.
-- In the order of the locks' numbers, as every taker takes them
-- (inbox_skip_lock.sql too), so two never wait on each other in a cycle;
-- keys of different subscriptions or keys that hash alike only wait for
-- each other. $1 subscription, $2 keys (a repeated one is locked once).
SELECT count(pg_advisory_xact_lock(k.lock)) AS locked
FROM (
    SELECT DISTINCT hashtextextended($1 || chr(31) || key, 0) AS lock
    FROM unnest($2::text[]) AS key
    ORDER BY 1
) k
