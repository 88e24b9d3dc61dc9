//! The outbox store: `PgOutboxStore` on PostgreSQL (a fresh database per
//! test) and `SimStore` on the fake PostgreSQL, the same bodies.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox::core::janitor;
use outbox::core::ports::{
    ClaimParams, OutboxStore, ParkedCursor, ParkedFilter, PayloadField, RowFailure, UnparkSelector,
};
use outbox::trace_context::TraceContext;
use outbox::{DrainerConfig, EventEnvelope, PgOutboxStore, Publisher};
use sim::adapters::{Hooks, PgClient, SimStore};
use sim::fakes::pg::{self, PgState};
use sim::trace::Trace;
use sim::wire::{NewRow, PgRequest};
use sqlx::PgPool;
use uuid::Uuid;

use crate::harness::in_sim;

/// What a store test can see of a row.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RowView {
    attempts: i32,
    published: bool,
    parked: bool,
    claimed_by: Option<String>,
}

/// One side of the store conformance suite.
trait StoreArm {
    type S: OutboxStore;
    fn store(&self) -> &Self::S;
    /// The same store, to hand to what must own one.
    fn shared(&self) -> Arc<Self::S>;
    /// Commits one envelope per transaction, in order; returns their ids.
    async fn insert(&self, n: usize, key: &str) -> Vec<Uuid> {
        let mut ids = Vec::new();
        for i in 0..n {
            let e = EventEnvelope::new(key, serde_json::json!({ "i": i }));
            self.insert_envelope(&e).await;
            ids.push(e.id);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        ids
    }
    /// Commits `e` in a transaction of its own.
    async fn insert_envelope(&self, e: &EventEnvelope);
    async fn row(&self, id: Uuid) -> Option<RowView>;
    /// Moves a row's `published_at` `secs` into the past.
    async fn backdate_published(&self, id: Uuid, secs: u64);
    /// The milliseconds a UUID v7 written now carries (the partitions'
    /// axis): the wall clock on the real server, simulated time on the
    /// fake.
    fn id_now_ms(&self) -> u64;
    /// The partition that holds row `id` (`None` on the plain layout).
    async fn partition_of(&self, id: Uuid) -> Option<String>;
    /// An open transaction of the caller's.
    type Tx;
    async fn begin(&self) -> Self::Tx;
    /// `publish_tx` of `e` in `tx` (waits while another open transaction
    /// holds `e`'s ordering key).
    async fn write(&self, tx: &mut Self::Tx, e: &EventEnvelope);
    async fn commit(&self, tx: Self::Tx);
}

struct RealStore {
    store: Arc<PgOutboxStore>,
    pool: PgPool,
}

impl StoreArm for RealStore {
    type S = PgOutboxStore;
    type Tx = sqlx::Transaction<'static, sqlx::Postgres>;
    async fn begin(&self) -> Self::Tx {
        self.pool.begin().await.unwrap()
    }
    async fn write(&self, tx: &mut Self::Tx, e: &EventEnvelope) {
        Publisher::new(self.pool.clone())
            .publish_tx(tx, e)
            .await
            .unwrap();
    }
    async fn commit(&self, tx: Self::Tx) {
        tx.commit().await.unwrap();
    }
    fn store(&self) -> &PgOutboxStore {
        &self.store
    }
    fn shared(&self) -> Arc<PgOutboxStore> {
        self.store.clone()
    }
    async fn insert_envelope(&self, e: &EventEnvelope) {
        Publisher::new(self.pool.clone()).publish(e).await.unwrap();
    }
    async fn row(&self, id: Uuid) -> Option<RowView> {
        sqlx::query_as::<_, (i32, bool, bool, Option<String>)>(
            "SELECT attempts, published_at IS NOT NULL, parked_at IS NOT NULL, claimed_by
             FROM event_outbox WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .unwrap()
        .map(|(attempts, published, parked, claimed_by)| RowView {
            attempts,
            published,
            parked,
            claimed_by,
        })
    }
    fn id_now_ms(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    }
    async fn partition_of(&self, id: Uuid) -> Option<String> {
        sqlx::query_scalar(
            "SELECT c.relname::TEXT FROM event_outbox o JOIN pg_class c ON c.oid = o.tableoid \
             WHERE o.id = $1 AND c.relispartition",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .unwrap()
    }
    async fn backdate_published(&self, id: Uuid, secs: u64) {
        sqlx::query("UPDATE event_outbox SET published_at = published_at - make_interval(secs => $2) WHERE id = $1")
            .bind(id)
            .bind(secs as f64)
            .execute(&self.pool)
            .await
            .unwrap();
    }
}

struct FakeStore {
    store: Arc<SimStore>,
    client: PgClient,
    state: PgState,
}

impl StoreArm for FakeStore {
    type S = SimStore;
    type Tx = PgClient;
    async fn begin(&self) -> PgClient {
        let c = PgClient::new("writer-tx", Trace::default());
        c.call(PgRequest::Begin).await.unwrap();
        c
    }
    async fn write(&self, tx: &mut PgClient, e: &EventEnvelope) {
        let reply = tx
            .call(PgRequest::Insert {
                rows: vec![NewRow {
                    id: e.id,
                    routing_key: e.routing_key.clone(),
                    body: e.encode(&Default::default()).unwrap(),
                    ordering_key: e.ordering_key.clone(),
                }],
            })
            .await
            .unwrap();
        assert!(matches!(reply, sim::wire::PgReply::Count(1)), "{reply:?}");
    }
    async fn commit(&self, tx: PgClient) {
        tx.call(PgRequest::Commit).await.unwrap();
    }
    fn store(&self) -> &SimStore {
        &self.store
    }
    fn shared(&self) -> Arc<SimStore> {
        self.store.clone()
    }
    async fn insert_envelope(&self, e: &EventEnvelope) {
        let body = e.encode(&Default::default()).unwrap();
        self.client
            .in_tx(vec![PgRequest::Insert {
                rows: vec![NewRow {
                    id: e.id,
                    routing_key: e.routing_key.clone(),
                    body,
                    ordering_key: e.ordering_key.clone(),
                }],
            }])
            .await
            .unwrap();
    }
    async fn row(&self, id: Uuid) -> Option<RowView> {
        let db = self.state.lock();
        db.outbox.row(&id).map(|r| RowView {
            attempts: r.attempts,
            published: r.published_ms.is_some(),
            parked: r.parked_ms.is_some(),
            claimed_by: r.claimed_by.clone(),
        })
    }
    async fn backdate_published(&self, id: Uuid, secs: u64) {
        self.state.lock().outbox.backdate_published(id, secs * 1000);
    }
    fn id_now_ms(&self) -> u64 {
        pg::id_ms(pg::now_ms())
    }
    async fn partition_of(&self, id: Uuid) -> Option<String> {
        let db = self.state.lock();
        let parts = db.outbox.partitions.as_ref()?;
        db.outbox.row(&id)?;
        Some(parts.name(parts.home(id)))
    }
}

/// Runs `body` against the fake PostgreSQL inside a simulation.
fn with_fake_store<F, Fut>(body: F)
where
    F: FnOnce(FakeStore) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    fake_store(PgState::new(7, Trace::default()), body);
}

/// As [`with_fake_store`], on the partitioned layout (a partition a
/// second).
fn with_fake_store_partitioned<F, Fut>(body: F)
where
    F: FnOnce(FakeStore) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    fake_store(PgState::new(7, Trace::default()).partition(1000), body);
}

fn fake_store<F, Fut>(state: PgState, body: F)
where
    F: FnOnce(FakeStore) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    let trace = state.trace().clone();
    let server = state.clone();
    in_sim(
        "pg",
        move || pg::serve(server.clone()),
        move || async move {
            let arm = FakeStore {
                store: Arc::new(SimStore::new("conformance", trace.clone(), Hooks::new(1))),
                client: PgClient::new("writer", trace),
                state,
            };
            body(arm).await;
        },
    );
}

fn params(replica: &str, batch: u32, ttl_ms: u64) -> ClaimParams<'_> {
    ClaimParams {
        replica_id: replica,
        batch_size: batch,
        lease_ttl: Duration::from_millis(ttl_ms),
        key_heads: &[],
        after: None,
    }
}

/// The drainer's claim with ordering keys: the claimable heads of the
/// first 100 keys, then the claim; the ids claimed.
async fn claim_keyed<S: OutboxStore>(s: &S, replica: &str, ttl_ms: u64) -> Vec<Uuid> {
    let ttl = Duration::from_millis(ttl_ms);
    let w = s.outbox_key_window("", 100, ttl).await.unwrap();
    let heads: Vec<Uuid> = w
        .heads
        .iter()
        .filter(|h| h.claimable)
        .map(|h| h.id)
        .collect();
    let rows = s
        .outbox_claim(ClaimParams {
            key_heads: &heads,
            ..params(replica, 100, ttl_ms)
        })
        .await
        .unwrap();
    rows.iter().map(|r| r.id).collect()
}

fn keyed(key: &str) -> EventEnvelope {
    EventEnvelope::new("k", serde_json::json!({})).with_ordering_key(key)
}

// ---- store bodies ------------------------------------------------------

async fn the_claim_returns_the_trace_context_and_the_age<A: StoreArm>(arm: A) {
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let traced = EventEnvelope::new("k", serde_json::json!({}))
        .with_header("traceparent", tp)
        .with_header("tracestate", "congo=t61rcWkgMzE");
    let bare = EventEnvelope::new("k", serde_json::json!({})).with_header("tenant", "ny");
    arm.insert_envelope(&traced).await;
    arm.insert_envelope(&bare).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rows = arm
        .store()
        .outbox_claim(params("a", 10, 60_000))
        .await
        .unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(
        rows[0].trace,
        Some(TraceContext::parse(tp, Some("congo=t61rcWkgMzE")).unwrap())
    );
    assert_eq!(rows[1].trace, None, "no traceparent header, no context");
    for row in &rows {
        assert!(
            row.age >= Duration::from_millis(250) && row.age < Duration::from_secs(60),
            "{:?}",
            row.age
        );
    }
}

async fn the_claimed_body_is_the_envelope_as_written<A: StoreArm>(arm: A) {
    // Keys in an order jsonb would change, a float, unicode, a long array:
    // jsonb renders it otherwise (keys by length, spaces after `:` and
    // `,`), which is not what reaches the broker (issue 25).
    let payload = serde_json::json!({
        "zeta": 1.5, "a": "é ü", "list": (0..50).collect::<Vec<_>>(), "mid": { "yy": true, "x": null }
    });
    let e = EventEnvelope::new("k", payload).with_header("tenant", "ny");
    let written = e.encode(&Default::default()).unwrap();
    arm.insert_envelope(&e).await;
    let rows = arm
        .store()
        .outbox_claim(params("a", 10, 60_000))
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(String::from_utf8(rows[0].body.clone()).unwrap(), written);
}

async fn claim_takes_oldest_first_stamps_the_lease_and_never_bumps<A: StoreArm>(arm: A) {
    let ids = arm.insert(5, "k").await;
    let rows = arm
        .store()
        .outbox_claim(params("a", 3, 60_000))
        .await
        .unwrap();
    let claimed: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
    assert_eq!(claimed, ids[..3], "oldest first, batch-limited");
    assert!(rows.iter().all(|r| r.attempts == 0 && r.routing_key == "k"));
    let env = EventEnvelope::decode(&rows[0].body).unwrap();
    assert_eq!(env.id, ids[0], "the body is the encoded envelope");
    let v = arm.row(ids[0]).await.unwrap();
    assert_eq!((v.claimed_by.as_deref(), v.attempts), (Some("a"), 0));
    // Leased rows are not claimed again; the rest are.
    let rows = arm
        .store()
        .outbox_claim(params("b", 10, 60_000))
        .await
        .unwrap();
    let claimed: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
    assert_eq!(claimed, ids[3..]);
    assert!(
        arm.store()
            .outbox_claim(params("c", 10, 60_000))
            .await
            .unwrap()
            .is_empty()
    );
}

/// A claim past a place (`ClaimParams::after`, a drain's walk) takes
/// unkeyed rows only after it in claim order, whatever is claimable behind
/// it; keyed heads are not bounded by it. Each row comes back with its
/// place, increasing in claim order.
async fn a_claim_past_a_place_takes_only_the_rows_after_it<A: StoreArm>(arm: A) {
    let head = keyed("x");
    arm.insert_envelope(&head).await;
    let ids = arm.insert(6, "k").await;
    let s = arm.store();
    let first = s.outbox_claim(params("a", 3, 60_000)).await.unwrap();
    let claimed: Vec<Uuid> = first.iter().map(|r| r.id).collect();
    assert_eq!(claimed, ids[..3], "from the oldest, unkeyed rows only");
    let places: Vec<_> = first.iter().map(|r| r.position.unwrap()).collect();
    assert!(places.is_sorted() && places[0] < places[2], "{places:?}");
    assert!(places.iter().zip(&claimed).all(|(p, id)| p.id == *id));
    // A row claimable again behind the place is left to a claim from the
    // oldest row.
    assert_eq!(s.outbox_release("a", &ids[..1]).await.unwrap(), 1);
    let after = Some(places[1]);
    let next = s
        .outbox_claim(ClaimParams {
            after,
            ..params("a", 2, 60_000)
        })
        .await
        .unwrap();
    let claimed: Vec<Uuid> = next.iter().map(|r| r.id).collect();
    assert_eq!(claimed, ids[3..5], "past the place, in claim order");
    let keyed_past = s
        .outbox_claim(ClaimParams {
            key_heads: &[head.id],
            after: next.last().unwrap().position,
            ..params("a", 10, 60_000)
        })
        .await
        .unwrap();
    let claimed: Vec<Uuid> = keyed_past.iter().map(|r| r.id).collect();
    assert_eq!(claimed, [head.id, ids[5]], "a key's head is not bounded");
    let oldest = s.outbox_claim(params("a", 10, 60_000)).await.unwrap();
    let claimed: Vec<Uuid> = oldest.iter().map(|r| r.id).collect();
    assert_eq!(claimed, ids[..1], "the released row, from the oldest");
}

async fn an_expired_lease_is_reclaimed_without_a_bump<A: StoreArm>(arm: A) {
    let ids = arm.insert(2, "k").await;
    assert_eq!(
        arm.store()
            .outbox_claim(params("a", 10, 1_000))
            .await
            .unwrap()
            .len(),
        2
    );
    assert!(
        arm.store()
            .outbox_claim(params("b", 10, 1_000))
            .await
            .unwrap()
            .is_empty()
    );
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let rows = arm
        .store()
        .outbox_claim(params("b", 10, 1_000))
        .await
        .unwrap();
    assert_eq!(rows.iter().map(|r| r.id).collect::<Vec<_>>(), ids);
    assert!(rows.iter().all(|r| r.attempts == 0));
    assert_eq!(
        arm.row(ids[0]).await.unwrap().claimed_by.as_deref(),
        Some("b")
    );
}

async fn marks_and_releases_are_guarded_by_claimed_by<A: StoreArm>(arm: A) {
    let ids = arm.insert(3, "k").await;
    arm.store()
        .outbox_claim(params("a", 10, 1_000))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    arm.store()
        .outbox_claim(params("b", 1, 1_000))
        .await
        .unwrap(); // b takes ids[0]
    // a's lease on ids[0] is gone: its mark changes nothing there.
    assert_eq!(
        arm.store()
            .outbox_mark_published("a", &ids[..2])
            .await
            .unwrap(),
        1
    );
    assert!(!arm.row(ids[0]).await.unwrap().published);
    assert!(arm.row(ids[1]).await.unwrap().published);
    assert_eq!(arm.store().outbox_release("a", &ids[..1]).await.unwrap(), 0);
    assert_eq!(arm.store().outbox_release("a", &ids[2..]).await.unwrap(), 1);
    assert_eq!(arm.row(ids[2]).await.unwrap().claimed_by, None);
    let f = arm
        .store()
        .outbox_mark_failed(
            "a",
            &[RowFailure {
                id: ids[0],
                error: "x".into(),
            }],
            3,
        )
        .await
        .unwrap();
    assert_eq!(f.recorded, 0, "a stale failure mark changes nothing");
    assert_eq!(
        arm.store()
            .outbox_mark_published("b", &ids[..1])
            .await
            .unwrap(),
        1
    );
}

async fn parked_rows_list_a_page_at_a_time<A: StoreArm>(arm: A) {
    let ids = arm.insert(3, "k").await;
    let rows = arm
        .store()
        .outbox_claim(params("a", 10, 60_000))
        .await
        .unwrap();
    assert_eq!(rows.len(), 3);
    for id in &ids {
        let failure = RowFailure {
            id: *id,
            error: "nack".into(),
        };
        let f = arm
            .store()
            .outbox_mark_failed("a", &[failure], 1)
            .await
            .unwrap();
        assert_eq!(f.parked, 1);
    }
    let s = arm.store();
    let list = |f: ParkedFilter| async move { s.outbox_list_parked(&f).await.unwrap() };
    let all = list(ParkedFilter::page(10, None)).await;
    assert_eq!(all.len(), 3);
    let first = list(ParkedFilter::page(2, None)).await;
    assert_eq!(first, all[..2]);
    let rest = list(ParkedFilter::page(10, Some(ParkedCursor::of(&first[1])))).await;
    assert_eq!(rest, all[2..]);
    let past = list(ParkedFilter::page(10, Some(ParkedCursor::of(&all[2])))).await;
    assert!(past.is_empty());
    // Without envelopes: the same rows, no envelope read.
    let bare = list(ParkedFilter {
        omit_envelope: true,
        ..ParkedFilter::page(10, None)
    })
    .await;
    let stripped: Vec<_> = all
        .iter()
        .map(|r| outbox::admin::ParkedRow {
            envelope: String::new(),
            ..r.clone()
        })
        .collect();
    assert_eq!(bare, stripped);
    // By id, and by a payload field the database matches ({"i": n}).
    let two = list(ParkedFilter {
        ids: Some(vec![ids[2], ids[0], Uuid::from_u128(7)]),
        ..ParkedFilter::page(10, None)
    })
    .await;
    let mut want = vec![ids[0], ids[2]];
    want.sort_by_key(|id| all.iter().position(|r| r.id == *id));
    assert_eq!(two.iter().map(|r| r.id).collect::<Vec<_>>(), want);
    for (value, matched) in [("1", Some(ids[1])), ("1.0", Some(ids[1])), ("\"1\"", None)] {
        let by_field = list(ParkedFilter {
            payload_field: Some(PayloadField::dotted("i", value)),
            ..ParkedFilter::page(10, None)
        })
        .await;
        let got: Vec<Uuid> = by_field.iter().map(|r| r.id).collect();
        assert_eq!(got, matched.into_iter().collect::<Vec<_>>(), "i = {value}");
    }
}

async fn failures_bump_attempts_park_at_the_budget_and_unpark_resets<A: StoreArm>(arm: A) {
    let ids = arm.insert(2, "k").await;
    let mut published_body = Vec::new();
    for round in 1..=3 {
        let rows = arm
            .store()
            .outbox_claim(params("a", 1, 60_000))
            .await
            .unwrap();
        assert_eq!(
            rows[0].id, ids[0],
            "round {round}: the failing row is claimed first"
        );
        assert_eq!(rows[0].attempts, round - 1);
        published_body = rows[0].body.clone();
        let f = arm
            .store()
            .outbox_mark_failed(
                "a",
                &[RowFailure {
                    id: ids[0],
                    error: format!("nack {round}"),
                }],
                3,
            )
            .await
            .unwrap();
        assert_eq!((f.recorded, f.parked), (1, u64::from(round == 3)));
        let v = arm.row(ids[0]).await.unwrap();
        assert_eq!(
            (v.attempts, v.parked, v.claimed_by),
            (round, round == 3, None)
        );
    }
    // Parked: skipped by the claim.
    let rows = arm
        .store()
        .outbox_claim(params("a", 10, 60_000))
        .await
        .unwrap();
    assert_eq!(rows.iter().map(|r| r.id).collect::<Vec<_>>(), [ids[1]]);
    let stats = arm.store().outbox_stats().await.unwrap();
    assert_eq!((stats.pending, stats.parked), (1, 1));
    let parked = arm
        .store()
        .outbox_list_parked(&ParkedFilter::page(10, None))
        .await
        .unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!((parked[0].id, parked[0].attempts), (ids[0], 3));
    assert_eq!(parked[0].last_error.as_deref(), Some("nack 3"));
    // Its envelope, as the drainer publishes it, for an operator to read.
    assert_eq!(parked[0].envelope.as_bytes(), published_body);
    assert_eq!(
        arm.store()
            .outbox_unpark(&UnparkSelector::Ids(vec![ids[1]]))
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        arm.store()
            .outbox_unpark(&UnparkSelector::All)
            .await
            .unwrap(),
        1
    );
    let v = arm.row(ids[0]).await.unwrap();
    assert_eq!((v.attempts, v.parked), (0, false));
    let rows = arm
        .store()
        .outbox_claim(params("b", 10, 60_000))
        .await
        .unwrap();
    assert_eq!(rows.iter().map(|r| r.id).collect::<Vec<_>>(), [ids[0]]);
}

async fn the_retention_sweep_deletes_only_old_published_rows<A: StoreArm>(arm: A) {
    let ids = arm.insert(4, "k").await;
    arm.store()
        .outbox_claim(params("a", 3, 60_000))
        .await
        .unwrap();
    arm.store()
        .outbox_mark_published("a", &ids[..3])
        .await
        .unwrap();
    arm.backdate_published(ids[0], 100).await;
    arm.backdate_published(ids[1], 100).await;
    let older = Duration::from_secs(50);
    assert_eq!(
        arm.store().outbox_delete_published(older, 1).await.unwrap(),
        1
    );
    // The janitor's sweep loops over one-row batches and counts what it
    // deleted.
    let cfg = DrainerConfig::builder()
        .retention(older)
        .janitor_batch(1)
        .build()
        .unwrap();
    assert_eq!(janitor::sweep(arm.store(), &cfg).await.unwrap(), 1);
    assert_eq!(
        arm.store()
            .outbox_delete_published(older, 10)
            .await
            .unwrap(),
        0
    );
    assert!(arm.row(ids[0]).await.is_none() && arm.row(ids[1]).await.is_none());
    assert!(arm.row(ids[2]).await.is_some(), "recently published stays");
    assert!(arm.row(ids[3]).await.is_some(), "unpublished stays");
}

/// Rows expire as fast as they were published a retention period ago: a
/// sweep bounded to a number of statements falls behind for good above
/// that rate (issue 28). One sweep deletes every row past retention.
async fn one_sweep_deletes_every_expired_row_however_many_statements<A: StoreArm>(arm: A) {
    let n = janitor::SWEEP_PROGRESS_EVERY as usize + 5;
    let ids = arm.insert(n, "k").await;
    let claimed = arm
        .store()
        .outbox_claim(params("a", n as u32, 60_000))
        .await
        .unwrap();
    assert_eq!(claimed.len(), n);
    arm.store().outbox_mark_published("a", &ids).await.unwrap();
    for id in &ids {
        arm.backdate_published(*id, 100).await;
    }
    let cfg = DrainerConfig::builder()
        .retention(Duration::from_secs(50))
        .janitor_batch(1)
        .build()
        .unwrap();
    // Rows of a partition dropped whole are not counted (the partitioned
    // layout's first partition may close while the rows are written).
    let deleted = janitor::sweep(arm.store(), &cfg).await.unwrap();
    assert!(deleted <= n as u64, "{deleted} of {n}");
    for id in &ids {
        assert!(arm.row(*id).await.is_none(), "{id} expired and stayed");
    }
}

/// A partition that closes while a sweep deletes rows goes in that sweep.
/// The row statements leave a closed partition that no unpublished row
/// holds to the drop; a pass over the partitions made only before them
/// found it still open, so it stayed until the next sweep (CI, stop 48: a
/// sweep slower than a partition's width left expired rows behind). Here
/// the row sweep starts after every partition the rows can be in closed.
async fn a_partition_that_closes_during_a_sweep_goes_in_that_sweep<A: StoreArm>(arm: A) {
    // Ids a second ahead: their partition is open when the sweep's first
    // pass runs, and closed (at most 3 s on: the cut lies 1–2 s after
    // the layout was made) once the pause is over.
    let t = arm.id_now_ms() + 1_000;
    let events: Vec<EventEnvelope> = (0..3u8)
        .map(|n| {
            let mut e = EventEnvelope::new("k", serde_json::json!({ "n": n }));
            e.id = uuid::Builder::from_unix_timestamp_millis(t, &[n; 10]).into_uuid();
            e
        })
        .collect();
    for e in &events {
        arm.insert_envelope(e).await;
    }
    let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
    assert_eq!(
        arm.store()
            .outbox_claim(params("a", 10, 60_000))
            .await
            .unwrap()
            .len(),
        3
    );
    arm.store().outbox_mark_published("a", &ids).await.unwrap();
    for id in &ids {
        arm.backdate_published(*id, 100).await;
    }
    let slow = PausedRowSweep {
        inner: arm.shared(),
        pause: Duration::from_millis(3_500),
        paused: AtomicBool::new(false),
    };
    let cfg = DrainerConfig::builder()
        .retention(Duration::from_secs(50))
        .janitor_batch(1)
        .build()
        .unwrap();
    janitor::sweep(&slow, &cfg).await.unwrap();
    for id in &ids {
        assert!(arm.row(*id).await.is_none(), "{id} expired and stayed");
    }
}

/// A store whose first row-sweep statement waits `pause` before it runs
/// (a sweep long enough for partitions to close during it).
struct PausedRowSweep<S> {
    inner: Arc<S>,
    pause: Duration,
    paused: AtomicBool,
}

impl<S: OutboxStore> outbox::core::ports::Replication for PausedRowSweep<S> {
    async fn replication_positions(
        &self,
        standbys: &[String],
    ) -> Result<outbox::core::ports::ReplicationPositions, outbox::StoreError> {
        self.inner.replication_positions(standbys).await
    }
}

impl<S: OutboxStore> OutboxStore for PausedRowSweep<S> {
    async fn outbox_key_window(
        &self,
        after: &str,
        limit: u32,
        ttl: Duration,
    ) -> Result<outbox::core::ports::KeyWindow, outbox::StoreError> {
        self.inner.outbox_key_window(after, limit, ttl).await
    }
    async fn outbox_claim(
        &self,
        p: ClaimParams<'_>,
    ) -> Result<Vec<outbox::core::ports::ClaimedRow>, outbox::StoreError> {
        self.inner.outbox_claim(p).await
    }
    async fn outbox_mark_published(
        &self,
        r: &str,
        ids: &[Uuid],
    ) -> Result<u64, outbox::StoreError> {
        self.inner.outbox_mark_published(r, ids).await
    }
    async fn outbox_mark_failed(
        &self,
        r: &str,
        f: &[RowFailure],
        m: u32,
    ) -> Result<outbox::core::ports::FailOutcome, outbox::StoreError> {
        self.inner.outbox_mark_failed(r, f, m).await
    }
    async fn outbox_release(&self, r: &str, ids: &[Uuid]) -> Result<u64, outbox::StoreError> {
        self.inner.outbox_release(r, ids).await
    }
    async fn outbox_stats(&self) -> Result<outbox::runtime::OutboxStats, outbox::StoreError> {
        self.inner.outbox_stats().await
    }
    async fn outbox_delete_published(
        &self,
        o: Duration,
        l: u32,
    ) -> Result<u64, outbox::StoreError> {
        if !self.paused.swap(true, Ordering::SeqCst) {
            tokio::time::sleep(self.pause).await;
        }
        self.inner.outbox_delete_published(o, l).await
    }
    async fn outbox_retire_partitions(
        &self,
        o: Duration,
    ) -> Result<outbox::core::ports::PartitionsRetired, outbox::StoreError> {
        self.inner.outbox_retire_partitions(o).await
    }
    async fn outbox_list_parked(
        &self,
        f: &ParkedFilter,
    ) -> Result<Vec<outbox::admin::ParkedRow>, outbox::StoreError> {
        self.inner.outbox_list_parked(f).await
    }
    async fn outbox_unpark(&self, s: &UnparkSelector) -> Result<u64, outbox::StoreError> {
        self.inner.outbox_unpark(s).await
    }
    async fn outbox_skip(&self, s: &UnparkSelector) -> Result<u64, outbox::StoreError> {
        self.inner.outbox_skip(s).await
    }
}

/// The partitioned layout's retention (issue 28): a closed partition whose
/// rows are all published and past retention goes whole; one holding an
/// unpublished row stays, and the row sweep takes its expired rows one by
/// one. On the plain layout the pass does nothing and says so.
async fn whole_partitions_go_once_every_row_expired<A: StoreArm>(arm: A) {
    let s = arm.store();
    let older = Duration::from_secs(50);
    let first = s.outbox_retire_partitions(older).await.unwrap();
    if !first.partitioned {
        assert_eq!(first, outbox::core::ports::PartitionsRetired::default());
        return;
    }
    // Past the first partition (the table as it was, up to the cut two
    // seconds on at most), then the partitions of the next seconds.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let ahead = s.outbox_retire_partitions(older).await.unwrap();
    assert!(!ahead.created.is_empty(), "{ahead:?}");
    let t = arm.id_now_ms();
    let at = |ms: u64, n: u64| {
        let mut e = EventEnvelope::new("k", serde_json::json!({ "n": n }));
        e.id = uuid::Builder::from_unix_timestamp_millis(ms, &[n as u8; 10]).into_uuid();
        e
    };
    // Second A: both rows published. Second A + 1: one published, one not.
    let (a1, a2, c, d) = (at(t, 1), at(t, 2), at(t + 1_000, 3), at(t + 1_000, 4));
    for e in [&a1, &a2, &c, &d] {
        arm.insert_envelope(e).await;
    }
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    let claimed = s.outbox_claim(params("a", 10, 60_000)).await.unwrap();
    assert_eq!(claimed.len(), 4);
    s.outbox_mark_published("a", &[a1.id, a2.id, c.id])
        .await
        .unwrap();
    for id in [a1.id, a2.id, c.id] {
        arm.backdate_published(id, 100).await;
    }
    let retired = s.outbox_retire_partitions(older).await.unwrap();
    assert!(!retired.dropped.is_empty(), "{retired:?}");
    assert!(arm.row(a1.id).await.is_none() && arm.row(a2.id).await.is_none());
    assert!(
        arm.row(c.id).await.is_some(),
        "a held partition is never dropped"
    );
    assert!(arm.row(d.id).await.is_some());
    assert_eq!(s.outbox_delete_published(older, 10).await.unwrap(), 1);
    assert!(
        arm.row(c.id).await.is_none(),
        "the row sweep takes a held partition's expired rows"
    );
    assert!(arm.row(d.id).await.is_some(), "never an unpublished row");
    // The held partition stays (empty partitions that closed meanwhile
    // may go: a slow run sees some).
    let held = outbox::pg::partitions::partition_name("event_outbox", (t + 1_000) / 1_000 * 1_000);
    let again = s.outbox_retire_partitions(older).await.unwrap();
    assert!(!again.dropped.contains(&held), "{again:?}");
    assert!(arm.row(d.id).await.is_some(), "never an unpublished row");
}

/// A row whose id is ahead of every partition (its writer's clock ran
/// fast) waits in DEFAULT only until its width's partition is created:
/// the creation takes it along, so the width's later rows go to their
/// partition and not to DEFAULT.
async fn a_row_ahead_of_the_partitions_never_blocks_its_partition<A: StoreArm>(arm: A) {
    let s = arm.store();
    let older = Duration::from_secs(50);
    if !s.outbox_retire_partitions(older).await.unwrap().partitioned {
        return;
    }
    // Three widths ahead are created; this id is six seconds on.
    let lo = (arm.id_now_ms() / 1_000 + 6) * 1_000;
    let at = |ms: u64, n: u8| {
        let mut e = EventEnvelope::new("k", serde_json::json!({ "n": n }));
        e.id = uuid::Builder::from_unix_timestamp_millis(ms, &[n; 10]).into_uuid();
        e
    };
    let early = at(lo + 500, 1);
    arm.insert_envelope(&early).await;
    let default = arm.partition_of(early.id).await.unwrap();
    assert!(default.ends_with("_default"), "{default}");
    let name = outbox::pg::partitions::partition_name("event_outbox", lo);
    let mut created = Vec::new();
    for _ in 0..12 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        created.extend(s.outbox_retire_partitions(older).await.unwrap().created);
        if created.contains(&name) {
            break;
        }
    }
    assert!(created.contains(&name), "{name} never created: {created:?}");
    assert_eq!(arm.partition_of(early.id).await.as_ref(), Some(&name));
    let later = at(lo + 900, 2);
    arm.insert_envelope(&later).await;
    assert_eq!(arm.partition_of(later.id).await.as_ref(), Some(&name));
    let row = arm.row(early.id).await.unwrap();
    assert!(
        !row.published && row.attempts == 0,
        "moved as it was: {row:?}"
    );
}

async fn two_concurrent_claimers_never_share_a_row<A: StoreArm>(arm: A) {
    arm.insert(40, "k").await;
    let s = arm.store();
    let (a, b) = futures_lite::future::zip(
        s.outbox_claim(params("a", 15, 60_000)),
        s.outbox_claim(params("b", 15, 60_000)),
    )
    .await;
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.len() + b.len(), 30);
    assert!(
        a.iter().all(|r| !b.iter().any(|x| x.id == r.id)),
        "SKIP LOCKED / leases keep claims disjoint"
    );
}

async fn a_claim_takes_only_each_keys_head<A: StoreArm>(arm: A) {
    let (a1, a2, b1) = (keyed("a"), keyed("a"), keyed("b"));
    let plain = EventEnvelope::new("k", serde_json::json!({}));
    for e in [&a1, &a2, &b1, &plain] {
        arm.insert_envelope(e).await;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let s = arm.store();
    assert_eq!(claim_keyed(s, "r1", 60_000).await, [a1.id, b1.id, plain.id]);
    assert!(
        claim_keyed(s, "r2", 60_000).await.is_empty(),
        "a2 waits while a1 is claimed"
    );
    let stale = s
        .outbox_claim(ClaimParams {
            key_heads: &[a2.id],
            ..params("r2", 10, 60_000)
        })
        .await
        .unwrap();
    assert!(stale.is_empty(), "a candidate that is not its key's head");
    assert_eq!(s.outbox_mark_published("r1", &[a1.id]).await.unwrap(), 1);
    let rows = s
        .outbox_claim(ClaimParams {
            key_heads: &[a2.id],
            ..params("r2", 10, 60_000)
        })
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    let o = rows[0].ordering.clone().unwrap();
    assert_eq!((o.key.as_str(), o.seq), ("a", 2));
}

async fn a_parked_head_holds_its_key_until_skipped<A: StoreArm>(arm: A) {
    let (k1, k2) = (keyed("k"), keyed("k"));
    arm.insert_envelope(&k1).await;
    arm.insert_envelope(&k2).await;
    let s = arm.store();
    assert_eq!(claim_keyed(s, "r", 60_000).await, [k1.id]);
    let fail = RowFailure {
        id: k1.id,
        error: "refused".into(),
    };
    assert_eq!(
        s.outbox_mark_failed("r", &[fail], 1).await.unwrap().parked,
        1
    );
    assert!(claim_keyed(s, "r", 60_000).await.is_empty());
    let st = s.outbox_stats().await.unwrap();
    assert_eq!((st.pending, st.parked, st.blocked), (1, 1, 1));
    let w = s.outbox_key_window("", 10, Duration::ZERO).await.unwrap();
    assert_eq!(w.heads.len(), 1);
    assert!(!w.heads[0].claimable && w.heads[0].id == k1.id);
    assert_eq!(
        s.outbox_skip(&UnparkSelector::Ids(vec![k2.id]))
            .await
            .unwrap(),
        0
    );
    assert_eq!(s.outbox_skip(&UnparkSelector::All).await.unwrap(), 1);
    let v = arm.row(k1.id).await.unwrap();
    assert!(v.published && v.parked, "skipped: done, never sent");
    assert_eq!(s.outbox_stats().await.unwrap().blocked, 0);
    assert_eq!(claim_keyed(s, "r", 60_000).await, [k2.id]);
}

/// Two writers of one key overlap: the one that began first writes second,
/// waits at its write until the other commits, and is numbered (and
/// claimed) second.
async fn overlapping_writers_of_a_key_are_claimed_in_commit_order<A: StoreArm>(arm: A) {
    let (early, late) = (keyed("k"), keyed("k"));
    let mut first = arm.begin().await;
    let mut second = arm.begin().await;
    arm.write(&mut second, &late).await;
    let done = std::cell::Cell::new(false);
    let waiting = async {
        arm.write(&mut first, &early).await;
        done.set(true);
        arm.commit(first).await;
    };
    let other = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!done.get(), "the second writer of the key waits");
        arm.commit(second).await;
    };
    futures_lite::future::zip(waiting, other).await;
    let s = arm.store();
    let rows = s
        .outbox_claim(ClaimParams {
            key_heads: &[early.id, late.id],
            ..params("r", 10, 60_000)
        })
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].id, late.id, "committed first, numbered first");
    assert_eq!(rows[0].ordering.as_ref().map(|o| o.seq), Some(1));
    s.outbox_mark_published("r", &[late.id]).await.unwrap();
    assert_eq!(claim_keyed(s, "r", 60_000).await, [early.id]);
}

/// The key window: heads of keys in byte order (`B` < `a` < `é` whatever
/// the collation), up to its limit, resumed after a key; a head is
/// claimable unless leased (until its lease expires) or parked.
async fn the_key_window_steps_through_keys_in_byte_order<A: StoreArm>(arm: A) {
    let (a1, e1, a2, b1) = (keyed("a"), keyed("é"), keyed("a"), keyed("B"));
    for e in [&a1, &e1, &a2, &b1] {
        arm.insert_envelope(e).await;
    }
    let s = arm.store();
    let w = s
        .outbox_key_window("", 2, Duration::from_secs(60))
        .await
        .unwrap();
    let got: Vec<_> = w
        .heads
        .iter()
        .map(|h| (h.key.as_str(), h.id, h.claimable))
        .collect();
    assert_eq!(got, [("B", b1.id, true), ("a", a1.id, true)]);
    assert!(!w.exhausted, "a full window may have keys after it");
    let rest = s
        .outbox_key_window("a", 2, Duration::from_secs(60))
        .await
        .unwrap();
    let got: Vec<_> = rest.heads.iter().map(|h| (h.key.as_str(), h.id)).collect();
    assert_eq!(got, [("é", e1.id)]);
    assert!(rest.exhausted);
    assert_eq!(claim_keyed(s, "r", 60_000).await.len(), 3);
    let w = s
        .outbox_key_window("", 10, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(w.heads.iter().all(|h| !h.claimable), "leased: {w:?}");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let w = s
        .outbox_key_window("", 10, Duration::from_millis(1))
        .await
        .unwrap();
    assert!(w.heads.iter().all(|h| h.claimable), "leases expired: {w:?}");
}

/// One transaction writing a key twice (and another key between) numbers
/// the key's events in the order it wrote them.
async fn one_transaction_numbers_its_keys_in_write_order<A: StoreArm>(arm: A) {
    let (k1, j1, k2) = (keyed("k"), keyed("j"), keyed("k"));
    let mut tx = arm.begin().await;
    for e in [&k1, &j1, &k2] {
        arm.write(&mut tx, e).await;
    }
    arm.commit(tx).await;
    let s = arm.store();
    let rows = s
        .outbox_claim(ClaimParams {
            key_heads: &[k1.id, j1.id, k2.id],
            ..params("r", 10, 60_000)
        })
        .await
        .unwrap();
    let got: Vec<_> = rows
        .iter()
        .map(|r| (r.id, r.ordering.as_ref().map(|o| (o.key.clone(), o.seq))))
        .collect();
    assert_eq!(
        got,
        [
            (k1.id, Some(("k".into(), 1))),
            (j1.id, Some(("j".into(), 1)))
        ]
    );
    s.outbox_mark_published("r", &[k1.id]).await.unwrap();
    let rows = s
        .outbox_claim(ClaimParams {
            key_heads: &[k2.id],
            ..params("r", 10, 60_000)
        })
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].ordering.as_ref().map(|o| o.seq), Some(2));
}

/// Runs `body` against PostgreSQL (a fresh database).
async fn with_real<F, Fut>(pool: PgPool, body: F)
where
    F: FnOnce(RealStore) -> Fut,
    Fut: Future<Output = ()>,
{
    body(RealStore {
        store: Arc::new(PgOutboxStore::new(pool.clone())),
        pool,
    })
    .await;
}

/// As [`with_real`], on the partitioned layout (a partition a second).
async fn with_real_partitioned<F, Fut>(pool: PgPool, body: F)
where
    F: FnOnce(RealStore) -> Fut,
    Fut: Future<Output = ()>,
{
    outbox::migrate::partition(&pool, Some(Duration::from_secs(1)))
        .await
        .unwrap();
    with_real(pool, body).await;
}

conformance!(postgres: with_real, fake: with_fake_store,
    partitioned: with_real_partitioned, with_fake_store_partitioned;
    whole_partitions_go_once_every_row_expired,
    the_claim_returns_the_trace_context_and_the_age,
    the_claimed_body_is_the_envelope_as_written,
    claim_takes_oldest_first_stamps_the_lease_and_never_bumps,
    a_claim_past_a_place_takes_only_the_rows_after_it,
    an_expired_lease_is_reclaimed_without_a_bump,
    marks_and_releases_are_guarded_by_claimed_by,
    failures_bump_attempts_park_at_the_budget_and_unpark_resets,
    parked_rows_list_a_page_at_a_time,
    the_retention_sweep_deletes_only_old_published_rows,
    one_sweep_deletes_every_expired_row_however_many_statements,
    a_partition_that_closes_during_a_sweep_goes_in_that_sweep,
    a_row_ahead_of_the_partitions_never_blocks_its_partition,
    two_concurrent_claimers_never_share_a_row,
    a_claim_takes_only_each_keys_head,
    a_parked_head_holds_its_key_until_skipped,
    overlapping_writers_of_a_key_are_claimed_in_commit_order,
    the_key_window_steps_through_keys_in_byte_order,
    one_transaction_numbers_its_keys_in_write_order,
);
