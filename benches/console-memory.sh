#!/usr/bin/env bash
# Peak memory (VmHWM) and answer times of the service example serving the
# console's dead-letter list over 3000 dead letters of 200 KB: one view,
# then three payload-filtered views at once. Uses its own database
# (dropped after) and port; the local PostgreSQL and RabbitMQ.
#
#   cargo build --release -p outbox-admin --example service
#   benches/console-memory.sh target/release/examples/service
set -u
BIN=${1:?the service example binary}
DB=outbox_console_mem
BASE=${PG_BASE:-postgres://postgres@127.0.0.1:5432}
TOKEN=console-memory-probe-token
PORT=${PORT:-18080}
mkdir -p /tmp/mem
psql $BASE/postgres -qc "DROP DATABASE IF EXISTS $DB WITH (FORCE)" 
CANOPY_MQ_ADMIN_TOKEN=$TOKEN CONSOLE_INSECURE_COOKIE=true DATABASE_URL=$BASE/$DB SERVICE_ADDR=127.0.0.1:$PORT RUST_LOG=warn \
  $BIN >/dev/null 2>/tmp/mem/service.err &
PID=$!
for _ in $(seq 1 100); do curl -s -o /dev/null localhost:$PORT/readyz && break; sleep 0.2; done
psql -q $BASE/$DB -c "INSERT INTO event_inbox (event_id, subscription, routing_key, payload, attempts, last_error, dead_lettered_at)
  SELECT gen_random_uuid(), 'service.example.shipments', 'orders.created',
         jsonb_build_object('id', gen_random_uuid(), 'routing_key', 'orders.created', 'payload', jsonb_build_object('n', g, 'pad', repeat('x', 200000))),
         5, 'boom', now() FROM generate_series(1, 3000) g"
hwm() { grep VmHWM /proc/$PID/status | awk '{print $2/1024 " MiB"}'; }
echo "before: $(hwm)"
J=/tmp/mem/jar; rm -f $J
curl -s -c $J -b $J localhost:$PORT/admin/login > /tmp/mem/login.html
CSRF=$(grep -o 'name=login_csrf value="[^"]*"' /tmp/mem/login.html | sed 's/.*value="//;s/"//')
[ -n "$CSRF" ] || CSRF=$(grep -o 'name="login_csrf" value="[^"]*"' /tmp/mem/login.html | sed 's/.*value="//;s/"//')
curl -s -c $J -b $J -o /dev/null -w "login %{http_code}\n" -d "login_csrf=$CSRF&token=$TOKEN" localhost:$PORT/admin/login
curl -s -m 60 -b $J -o /tmp/mem/dead.html -w "one view: %{http_code} in %{time_total} s\n" localhost:$PORT/admin/dead
echo "after one view: $(hwm)"
P=""
for i in 1 2 3; do curl -s -m 60 -b $J -o /dev/null -w "filtered view $i: %{http_code} in %{time_total} s\n" "localhost:$PORT/admin/dead?path=n&value=2999" & P="$P $!"; done; wait $P
echo "after three filtered views at once: $(hwm)"
echo "rows on the page: $(grep -o "<tr" /tmp/mem/dead.html | wc -l); says: $(grep -o "[0-9]* match[a-z]*" /tmp/mem/dead.html | head -2 | tr "\n" " ")"
kill $PID; wait $PID 2>/dev/null
psql $BASE/postgres -qc "DROP DATABASE IF EXISTS $DB WITH (FORCE)"
