//! The inbox store: the same bodies against `PgInboxStore` on the local
//! PostgreSQL (a fresh database per test) and `SimInboxStore` on the fake
//! PostgreSQL, including the data PostgreSQL refuses to store, which the
//! fake must refuse alike.

use std::future::Future;
use std::time::Duration;

use outbox::core::janitor::{InboxJanitorSettings, sweep_inbox};
use outbox::core::ports::{
    AttemptRecord, InboxCounts, InboxEntry, InboxFilter, InboxStore, InsertOutcome, TxBounds,
};
use outbox::pg::inbox::PgInboxTx;
use outbox::{EventEnvelope, HandlerError, PgInboxStore, StoreError};
use sim::adapters::{PgClient, SimInboxStore, SimTx};
use sim::fakes::pg::{self, PgState};
use sim::trace::Trace;
use sim::wire::PgRequest;
use sqlx::PgPool;
use uuid::Uuid;

use crate::harness::in_sim;

/// The bounds every body's transactions run under: a handler deadline of
/// five seconds.
fn bounds() -> TxBounds {
    TxBounds::for_handler(Duration::from_secs(5))
}

/// One side of the suite.
trait InboxArm {
    type S: InboxStore;
    fn store(&self) -> &Self::S;
    /// A second store (another replica's connections) on the same database.
    fn other(&self) -> &Self::S;
    /// The handler's domain write, in the transaction.
    async fn effect(&self, tx: &mut <Self::S as InboxStore>::Tx, id: Uuid);
    /// A handler statement that fails (division by zero), aborting the
    /// transaction.
    async fn failing_statement(&self, tx: &mut <Self::S as InboxStore>::Tx);
    /// Committed effects of `id`.
    async fn effects(&self, id: Uuid) -> u32;
    /// The handler's domain write, its error returned as the handler
    /// would see it.
    async fn try_effect(
        &self,
        tx: &mut <Self::S as InboxStore>::Tx,
        id: Uuid,
    ) -> Result<(), HandlerError>;
    /// The domain write of `id` taking `key` under a deferred unique
    /// constraint (`key` starts with `unique.`).
    async fn keyed_effect(
        &self,
        tx: &mut <Self::S as InboxStore>::Tx,
        id: Uuid,
        key: &str,
    ) -> Result<(), HandlerError>;
    /// Another session takes (or frees) the domain table's lock, as `LOCK
    /// TABLE … IN SHARE MODE` in an open transaction.
    async fn hold_domain_lock(&self, held: bool);
    /// `SET LOCAL lock_timeout` in the transaction.
    async fn set_lock_timeout(&self, tx: &mut <Self::S as InboxStore>::Tx, ms: u64);
    /// The transaction's `application_name`.
    fn tag(tx: &<Self::S as InboxStore>::Tx) -> String;
    /// `pg_cancel_backend` of the session running under `tag`, from
    /// another session.
    async fn cancel(&self, tag: &str);
    /// Moves a row's `processed_at` `secs` into the past.
    async fn backdate_processed(&self, id: Uuid, secs: u64);
    /// The milliseconds a UUID v7 written now carries (the partitions'
    /// axis): the wall clock on the real server, simulated time on the
    /// fake.
    fn id_now_ms(&self) -> u64;
}

struct Real {
    store: PgInboxStore,
    other: PgInboxStore,
    pool: PgPool,
    locker: tokio::sync::Mutex<Option<sqlx::Transaction<'static, sqlx::Postgres>>>,
}

impl InboxArm for Real {
    type S = PgInboxStore;
    fn store(&self) -> &PgInboxStore {
        &self.store
    }
    fn other(&self) -> &PgInboxStore {
        &self.other
    }
    async fn effect(&self, tx: &mut PgInboxTx, id: Uuid) {
        sqlx::query("INSERT INTO effects (event_id) VALUES ($1)")
            .bind(id)
            .execute(&mut ***tx)
            .await
            .unwrap();
    }
    async fn failing_statement(&self, tx: &mut PgInboxTx) {
        let e = sqlx::query("SELECT 1/0")
            .execute(&mut ***tx)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("division by zero"), "{e}");
    }
    async fn effects(&self, id: Uuid) -> u32 {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE event_id = $1")
            .bind(id)
            .fetch_one(&self.pool)
            .await
            .unwrap();
        n as u32
    }
    async fn try_effect(&self, tx: &mut PgInboxTx, id: Uuid) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO effects (event_id) VALUES ($1)")
            .bind(id)
            .execute(&mut ***tx)
            .await?;
        Ok(())
    }
    async fn keyed_effect(
        &self,
        tx: &mut PgInboxTx,
        id: Uuid,
        key: &str,
    ) -> Result<(), HandlerError> {
        self.try_effect(tx, id).await?;
        sqlx::query("INSERT INTO keyed (k, event_id) VALUES ($1, $2)")
            .bind(key)
            .bind(id)
            .execute(&mut ***tx)
            .await?;
        Ok(())
    }
    async fn hold_domain_lock(&self, held: bool) {
        let mut locker = self.locker.lock().await;
        if held {
            let mut tx = self.pool.begin().await.unwrap();
            sqlx::raw_sql("LOCK TABLE effects, keyed IN SHARE MODE")
                .execute(&mut *tx)
                .await
                .unwrap();
            *locker = Some(tx);
        } else if let Some(tx) = locker.take() {
            tx.rollback().await.unwrap();
        }
    }
    async fn set_lock_timeout(&self, tx: &mut PgInboxTx, ms: u64) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SET LOCAL lock_timeout = '{ms}ms'"
        )))
        .execute(&mut ***tx)
        .await
        .unwrap();
    }
    fn tag(tx: &PgInboxTx) -> String {
        tx.tag().to_owned()
    }
    async fn cancel(&self, tag: &str) {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FILTER (WHERE pg_cancel_backend(pid)) FROM \
             (SELECT pid FROM pg_stat_activity WHERE application_name = $1) AS t",
        )
        .bind(tag)
        .fetch_one(&self.pool)
        .await
        .unwrap();
        assert_eq!(n, 1, "one session runs under {tag}");
    }
    async fn backdate_processed(&self, id: Uuid, secs: u64) {
        sqlx::query(
            "UPDATE event_inbox SET processed_at = processed_at - make_interval(secs => $2) \
             WHERE event_id = $1",
        )
        .bind(id)
        .bind(secs as f64)
        .execute(&self.pool)
        .await
        .unwrap();
    }
    fn id_now_ms(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    }
}

struct Fake {
    store: SimInboxStore,
    other: SimInboxStore,
    state: PgState,
    /// Another client, for what another session does.
    outside: PgClient,
}

impl InboxArm for Fake {
    type S = SimInboxStore;
    fn store(&self) -> &SimInboxStore {
        &self.store
    }
    fn other(&self) -> &SimInboxStore {
        &self.other
    }
    async fn effect(&self, tx: &mut SimTx, id: Uuid) {
        tx.effect("q", id, None).await.unwrap();
    }
    async fn failing_statement(&self, tx: &mut SimTx) {
        let e = tx
            .call(sim::wire::PgRequest::Raise {
                code: "22012".into(),
            })
            .await
            .unwrap_err();
        assert!(matches!(e, StoreError::Refused(_)), "{e}");
    }
    async fn effects(&self, id: Uuid) -> u32 {
        let db = self.state.lock();
        db.inbox
            .effects()
            .get(&("q".to_owned(), id))
            .copied()
            .unwrap_or(0)
    }
    async fn backdate_processed(&self, id: Uuid, secs: u64) {
        self.state.lock().inbox.backdate_processed(id, secs * 1000);
    }
    fn id_now_ms(&self) -> u64 {
        pg::id_ms(pg::now_ms())
    }
    async fn try_effect(&self, tx: &mut SimTx, id: Uuid) -> Result<(), HandlerError> {
        Ok(tx.effect("q", id, None).await?)
    }
    async fn keyed_effect(&self, tx: &mut SimTx, id: Uuid, key: &str) -> Result<(), HandlerError> {
        Ok(tx.effect("q", id, Some(key.to_owned())).await?)
    }
    async fn hold_domain_lock(&self, held: bool) {
        self.state.set_domain_lock(held);
    }
    async fn set_lock_timeout(&self, tx: &mut SimTx, ms: u64) {
        tx.call(PgRequest::SetLocal(sim::wire::TxSettings {
            lock_ms: Some(ms),
            ..Default::default()
        }))
        .await
        .unwrap();
    }
    fn tag(tx: &SimTx) -> String {
        tx.tag().to_owned()
    }
    async fn cancel(&self, tag: &str) {
        let n = self
            .outside
            .call(PgRequest::Cancel {
                application_name: tag.to_owned(),
            })
            .await
            .unwrap();
        assert!(matches!(n, sim::wire::PgReply::Count(1)), "{n:?}");
    }
}

fn with_fake<F, Fut>(body: F)
where
    F: FnOnce(Fake) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    fake(PgState::new(11, Trace::default()), body);
}

/// As [`with_fake`], on the partitioned layout (a partition a second).
fn with_fake_partitioned<F, Fut>(body: F)
where
    F: FnOnce(Fake) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    fake(PgState::new(11, Trace::default()).partition(1000), body);
}

fn fake<F, Fut>(state: PgState, body: F)
where
    F: FnOnce(Fake) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    let trace = state.trace().clone();
    let server = state.clone();
    in_sim(
        "pg",
        move || pg::serve(server.clone()),
        move || async move {
            body(Fake {
                store: SimInboxStore::new("consumer-a", trace.clone()),
                other: SimInboxStore::new("consumer-b", trace.clone()),
                state,
                outside: PgClient::new("outside", trace),
            })
            .await;
        },
    );
}

async fn with_real<F, Fut>(pool: PgPool, body: F)
where
    F: FnOnce(Real) -> Fut,
    Fut: Future<Output = ()>,
{
    sqlx::query("CREATE TABLE effects (event_id UUID NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE keyed (k TEXT NOT NULL UNIQUE DEFERRABLE INITIALLY DEFERRED, event_id UUID NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    body(Real {
        store: PgInboxStore::new(pool.clone()),
        other: PgInboxStore::new(pool.clone()),
        pool,
        locker: tokio::sync::Mutex::new(None),
    })
    .await;
}

struct Event {
    id: Uuid,
    payload: String,
}

fn event(key: &str) -> Event {
    let e = EventEnvelope::new(key, serde_json::json!({ "k": key }));
    Event {
        id: e.id,
        payload: e.encode(&Default::default()).unwrap(),
    }
}

fn entry<'a>(e: &'a Event, key: &'a str) -> InboxEntry<'a> {
    entry_of("q", e, key)
}

/// `e` as subscription `subscription` receives it.
fn entry_of<'a>(subscription: &'a str, e: &'a Event, key: &'a str) -> InboxEntry<'a> {
    InboxEntry {
        event_id: e.id,
        subscription,
        routing_key: key,
        payload: e.payload.as_bytes(),
        fresh_budget: false,
        ordering: None,
    }
}

/// `e` as an ordered subscription `q` receives it: number `seq` of `key`.
fn keyed<'a>(e: &'a Event, o: &'a outbox::core::ports::KeySeq) -> InboxEntry<'a> {
    InboxEntry {
        ordering: Some(o),
        ..entry(e, "k")
    }
}

fn ks(key: &str, seq: i64) -> outbox::core::ports::KeySeq {
    outbox::core::ports::KeySeq {
        key: key.into(),
        seq,
    }
}

/// BEGIN, and the key lock of `entry` if it is keyed (as the subscriber
/// takes it, first in the transaction).
async fn begin_for<S: InboxStore>(store: &S, entry: &InboxEntry<'_>) -> S::Tx {
    let mut tx = store.inbox_begin(bounds()).await.unwrap();
    if let Some(o) = entry.ordering {
        store
            .inbox_lock_keys(&mut tx, entry.subscription, &[o.key.as_str()])
            .await
            .unwrap();
    }
    tx
}

/// BEGIN, try_insert of `entry`, COMMIT (nothing else): what the insert
/// found.
async fn insert_only<S: InboxStore>(store: &S, entry: &InboxEntry<'_>) -> InsertOutcome {
    let mut tx = begin_for(store, entry).await;
    let outcome = store.inbox_try_insert(&mut tx, entry).await.unwrap();
    store.inbox_commit(tx).await.unwrap();
    outcome
}

/// BEGIN, try_insert, effect, mark, COMMIT; returns the insert outcome.
async fn apply<A: InboxArm>(arm: &A, store: &A::S, e: &Event) -> InsertOutcome {
    apply_entry(arm, store, &entry(e, "k")).await
}

/// [`apply`] of an entry as given.
async fn apply_entry<A: InboxArm>(arm: &A, store: &A::S, entry: &InboxEntry<'_>) -> InsertOutcome {
    let mut tx = begin_for(store, entry).await;
    let outcome = store.inbox_try_insert(&mut tx, entry).await.unwrap();
    if outcome != InsertOutcome::AlreadyProcessed {
        arm.effect(&mut tx, entry.event_id).await;
        store.inbox_mark_processed(&mut tx, entry).await.unwrap();
    }
    store.inbox_commit(tx).await.unwrap();
    outcome
}

/// Replay's reset alone: BEGIN, try_insert with a fresh budget, COMMIT.
async fn reset<S: InboxStore>(store: &S, entry: &InboxEntry<'_>) -> InsertOutcome {
    let replay = InboxEntry {
        fresh_budget: true,
        ..*entry
    };
    let mut tx = begin_for(store, entry).await;
    let outcome = store.inbox_try_insert(&mut tx, &replay).await.unwrap();
    store.inbox_commit(tx).await.unwrap();
    outcome
}

/// One failed attempt: BEGIN, try_insert, the handler's effect, then the
/// failure recorded against `max_attempts`, COMMIT.
async fn fail<A: InboxArm>(
    arm: &A,
    store: &A::S,
    e: &Event,
    key: &str,
    max_attempts: u32,
) -> AttemptRecord {
    let mut tx = store.inbox_begin(bounds()).await.unwrap();
    store
        .inbox_try_insert(&mut tx, &entry(e, key))
        .await
        .unwrap();
    store.inbox_savepoint(&mut tx).await.unwrap();
    arm.effect(&mut tx, e.id).await;
    let r = store
        .inbox_record_failure(&mut tx, &entry(e, key), "boom", max_attempts)
        .await
        .unwrap();
    store.inbox_commit(tx).await.unwrap();
    r
}

// ---- bodies --------------------------------------------------------------

async fn a_replays_fresh_budget_takes_effect_only_with_its_commit<A: InboxArm>(arm: A) {
    let e = event("k");
    let s = arm.store();
    assert!(fail(&arm, s, &e, "k", 1).await.dead_lettered);
    let replay = InboxEntry {
        fresh_budget: true,
        ..entry(&e, "k")
    };
    let dead = InboxFilter {
        dead_lettered_only: true,
        ..InboxFilter::default()
    };
    // A replay cut short (rolled back) leaves the row dead-lettered.
    let mut tx = s.inbox_begin(bounds()).await.unwrap();
    assert_eq!(
        s.inbox_try_insert(&mut tx, &replay).await.unwrap(),
        InsertOutcome::InFlightRetry { attempts: 0 }
    );
    s.inbox_rollback(tx).await;
    let rows = s.inbox_list_unprocessed(&dead).await.unwrap();
    assert_eq!(
        rows.iter()
            .map(|r| (r.event_id, r.attempts))
            .collect::<Vec<_>>(),
        [(e.id, 1)]
    );
    // A replay whose handler fails again: a budget of one from zero.
    let mut tx = s.inbox_begin(bounds()).await.unwrap();
    s.inbox_try_insert(&mut tx, &replay).await.unwrap();
    s.inbox_savepoint(&mut tx).await.unwrap();
    arm.effect(&mut tx, e.id).await;
    let r = s
        .inbox_record_failure(&mut tx, &replay, "again", 1)
        .await
        .unwrap();
    assert_eq!(
        r,
        AttemptRecord {
            attempts: 1,
            dead_lettered: true
        }
    );
    s.inbox_commit(tx).await.unwrap();
    assert_eq!(s.inbox_list_unprocessed(&dead).await.unwrap().len(), 1);
    // A replay that succeeds: processed, out of the dead-lettered set.
    assert_eq!(
        apply_entry(&arm, s, &replay).await,
        InsertOutcome::InFlightRetry { attempts: 0 }
    );
    assert!(s.inbox_list_unprocessed(&dead).await.unwrap().is_empty());
    assert_eq!(arm.effects(e.id).await, 1);
}

async fn the_counts_say_what_was_processed_recently_is_retried_and_dead_lettered<A: InboxArm>(
    arm: A,
) {
    let s = arm.store();
    let hour = Duration::from_secs(3600);
    let counts = |window, cap| async move { s.inbox_counts("q", window, cap).await.unwrap() };
    assert_eq!(counts(hour, 100).await, InboxCounts::default());
    let (a, b, c, d) = (event("k"), event("k"), event("k"), event("k"));
    assert_eq!(apply(&arm, s, &a).await, InsertOutcome::Inserted);
    assert_eq!(apply(&arm, s, &b).await, InsertOutcome::Inserted);
    assert!(!fail(&arm, s, &c, "k", 5).await.dead_lettered);
    assert!(fail(&arm, s, &d, "k", 1).await.dead_lettered);
    // Another subscription's rows are its own.
    let other = apply_entry(&arm, s, &entry_of("other", &c, "k")).await;
    assert_eq!(other, InsertOutcome::Inserted);
    let all = InboxCounts {
        processed_recently: 2,
        retrying: 1,
        dead_lettered: 1,
    };
    assert_eq!(counts(hour, 100).await, all);
    // Each count stops at the cap.
    let capped = InboxCounts {
        processed_recently: 1,
        ..all
    };
    assert_eq!(counts(hour, 1).await, capped);
    // A row processed before the window is not recent; the rest stay.
    arm.backdate_processed(a.id, 7200).await;
    let recent = InboxCounts {
        processed_recently: 1,
        ..all
    };
    assert_eq!(counts(hour, 100).await, recent);
    // A replayed dead letter that succeeds leaves the dead-lettered count.
    let replay = InboxEntry {
        fresh_budget: true,
        ..entry(&d, "k")
    };
    apply_entry(&arm, s, &replay).await;
    let replayed = InboxCounts {
        processed_recently: 2,
        dead_lettered: 0,
        ..all
    };
    assert_eq!(counts(hour, 100).await, replayed);
}

async fn two_subscriptions_each_take_an_events_effect<A: InboxArm>(arm: A) {
    // One event bound to two queues of one service: each subscription has
    // its own row, effect and budget.
    let e = event("k");
    let s = arm.store();
    for subscription in ["q", "q2"] {
        let mut tx = s.inbox_begin(bounds()).await.unwrap();
        let entry = entry_of(subscription, &e, "k");
        assert_eq!(
            s.inbox_try_insert(&mut tx, &entry).await.unwrap(),
            InsertOutcome::Inserted,
            "{subscription}"
        );
        arm.effect(&mut tx, e.id).await;
        s.inbox_mark_processed(&mut tx, &entry).await.unwrap();
        s.inbox_commit(tx).await.unwrap();
    }
    assert_eq!(arm.effects(e.id).await, 2);
    // A failure recorded for one subscription leaves the other's row alone.
    let f = event("k");
    fail(&arm, s, &f, "k", 1).await;
    let mut tx = s.inbox_begin(bounds()).await.unwrap();
    assert_eq!(
        s.inbox_try_insert(&mut tx, &entry_of("q2", &f, "k"))
            .await
            .unwrap(),
        InsertOutcome::Inserted
    );
    s.inbox_rollback(tx).await;
    // A duplicate is recognised per subscription.
    let mut tx = s.inbox_begin(bounds()).await.unwrap();
    assert_eq!(
        s.inbox_try_insert(&mut tx, &entry_of("q2", &e, "k"))
            .await
            .unwrap(),
        InsertOutcome::AlreadyProcessed
    );
    s.inbox_commit(tx).await.unwrap();
    // Replay's reset is the subscription's own row's.
    assert_eq!(
        reset(s, &entry_of("q", &f, "k")).await,
        InsertOutcome::InFlightRetry { attempts: 0 }
    );
}

async fn a_committed_event_is_already_processed_the_second_time<A: InboxArm>(arm: A) {
    let e = event("k");
    assert_eq!(apply(&arm, arm.store(), &e).await, InsertOutcome::Inserted);
    assert_eq!(
        apply(&arm, arm.other(), &e).await,
        InsertOutcome::AlreadyProcessed
    );
    assert_eq!(arm.effects(e.id).await, 1);
}

async fn a_rolled_back_attempt_leaves_only_its_recorded_failure<A: InboxArm>(arm: A) {
    let e = event("k");
    let s = arm.store();
    let mut tx = s.inbox_begin(bounds()).await.unwrap();
    assert_eq!(
        s.inbox_try_insert(&mut tx, &entry(&e, "k")).await.unwrap(),
        InsertOutcome::Inserted
    );
    arm.effect(&mut tx, e.id).await;
    s.inbox_rollback(tx).await;
    assert_eq!(arm.effects(e.id).await, 0, "the effect rolled back");
    let listed = s
        .inbox_list_unprocessed(&InboxFilter {
            subscription: Some("q".into()),
            ..InboxFilter::default()
        })
        .await
        .unwrap();
    assert!(listed.is_empty(), "the inserted row rolled back too");
    // Each failed attempt undoes the handler's effect (back to the
    // savepoint) but keeps the row, and counts once.
    for want in [(1, false), (2, false), (3, true), (4, true)] {
        let r = fail(&arm, s, &e, "k", 3).await;
        assert_eq!(
            r,
            AttemptRecord {
                attempts: want.0,
                dead_lettered: want.1
            }
        );
        assert_eq!(arm.effects(e.id).await, 0, "the effect rolled back");
    }
    let mut tx = s.inbox_begin(bounds()).await.unwrap();
    assert_eq!(
        s.inbox_try_insert(&mut tx, &entry(&e, "k")).await.unwrap(),
        InsertOutcome::InFlightRetry { attempts: 4 }
    );
    s.inbox_rollback(tx).await;
    let rows = s
        .inbox_list_unprocessed(&InboxFilter {
            dead_lettered_only: true,
            ..InboxFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].event_id, e.id);
    assert_eq!(rows[0].attempts, 4);
    assert_eq!(rows[0].last_error.as_deref(), Some("boom"));
    assert!(rows[0].dead_lettered_at.is_some());
    // jsonb normalizes the text; the envelope it holds is the same.
    assert_eq!(
        EventEnvelope::decode(&rows[0].payload).unwrap(),
        EventEnvelope::decode(e.payload.as_bytes()).unwrap()
    );
}

async fn a_concurrent_delivery_waits_for_the_first_and_sees_its_outcome<A: InboxArm>(arm: A) {
    let e = event("k");
    let (a, b) = (arm.store(), arm.other());
    // A holds the row; B's insert waits until A commits, then finds it done.
    let mut tx = a.inbox_begin(bounds()).await.unwrap();
    assert_eq!(
        a.inbox_try_insert(&mut tx, &entry(&e, "k")).await.unwrap(),
        InsertOutcome::Inserted
    );
    let second = async {
        let mut tx = b.inbox_begin(bounds()).await.unwrap();
        let o = b.inbox_try_insert(&mut tx, &entry(&e, "k")).await.unwrap();
        b.inbox_commit(tx).await.unwrap();
        o
    };
    let first = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        arm.effect(&mut tx, e.id).await;
        a.inbox_mark_processed(&mut tx, &entry(&e, "k"))
            .await
            .unwrap();
        a.inbox_commit(tx).await.unwrap();
    };
    let ((), outcome) = futures_lite::future::zip(first, second).await;
    assert_eq!(outcome, InsertOutcome::AlreadyProcessed);
    assert_eq!(arm.effects(e.id).await, 1);

    // A second event: A rolls back, so B inserts it afresh.
    let f = event("k");
    let mut tx = a.inbox_begin(bounds()).await.unwrap();
    a.inbox_try_insert(&mut tx, &entry(&f, "k")).await.unwrap();
    let second = async {
        let mut tx = b.inbox_begin(bounds()).await.unwrap();
        let o = b.inbox_try_insert(&mut tx, &entry(&f, "k")).await.unwrap();
        b.inbox_rollback(tx).await;
        o
    };
    let first = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        a.inbox_rollback(tx).await;
    };
    let ((), outcome) = futures_lite::future::zip(first, second).await;
    assert_eq!(outcome, InsertOutcome::Inserted);
}

async fn replay_listing_filters_orders_and_resets_the_budget<A: InboxArm>(arm: A) {
    let s = arm.store();
    let (a, b, c) = (event("k.a"), event("k.b"), event("k.a"));
    for (e, key) in [(&a, "k.a"), (&b, "k.b"), (&c, "k.a")] {
        fail(&arm, s, e, key, 1).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ids = |rows: Vec<outbox::core::ports::InboxRow>| {
        rows.iter().map(|r| r.event_id).collect::<Vec<_>>()
    };
    let all = s
        .inbox_list_unprocessed(&InboxFilter {
            dead_lettered_only: true,
            ..InboxFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(ids(all), vec![a.id, b.id, c.id], "oldest first");
    let by_key = s
        .inbox_list_unprocessed(&InboxFilter {
            routing_key: Some("k.a".into()),
            limit: Some(1),
            ..InboxFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(ids(by_key), vec![a.id]);
    let by_id = s
        .inbox_list_unprocessed(&InboxFilter {
            ids: Some(vec![c.id, Uuid::now_v7()]),
            ..InboxFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(ids(by_id), vec![c.id]);
    for e in [&a, &b] {
        assert_eq!(
            reset(s, &entry(e, "k")).await,
            InsertOutcome::InFlightRetry { attempts: 0 }
        );
    }
    let still_dead = s
        .inbox_list_unprocessed(&InboxFilter {
            dead_lettered_only: true,
            ..InboxFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(ids(still_dead), vec![c.id]);
    // Processed rows are not reset.
    assert_eq!(
        apply(&arm, s, &a).await,
        InsertOutcome::InFlightRetry { attempts: 0 }
    );
    assert_eq!(
        reset(s, &entry(&a, "k")).await,
        InsertOutcome::AlreadyProcessed
    );
}

/// A fresh budget is a dead-lettered row's: a row within its budget keeps
/// its attempts (two releases of one held row that race never reset what
/// the other spent), and a dead-lettered one starts from zero.
async fn a_fresh_budget_resets_a_dead_lettered_row_only<A: InboxArm>(arm: A) {
    let s = arm.store();
    let (live, dead) = (event("k"), event("k"));
    assert!(!fail(&arm, s, &live, "k", 5).await.dead_lettered);
    assert!(fail(&arm, s, &dead, "k", 1).await.dead_lettered);
    assert_eq!(
        reset(s, &entry(&live, "k")).await,
        InsertOutcome::InFlightRetry { attempts: 1 }
    );
    assert_eq!(
        fail(&arm, s, &live, "k", 5).await,
        AttemptRecord {
            attempts: 2,
            dead_lettered: false
        }
    );
    assert_eq!(
        reset(s, &entry(&dead, "k")).await,
        InsertOutcome::InFlightRetry { attempts: 0 }
    );
    // Reset once: now within its budget, a second reset leaves it.
    assert_eq!(
        fail(&arm, s, &dead, "k", 5).await,
        AttemptRecord {
            attempts: 1,
            dead_lettered: false
        }
    );
    assert_eq!(
        reset(s, &entry(&dead, "k")).await,
        InsertOutcome::InFlightRetry { attempts: 1 }
    );
}

/// The subscriber pings when a handler overruns its deadline: the ping
/// answers on a connection of its own, beside a handler transaction that
/// holds an inbox row.
async fn a_ping_answers_beside_an_open_handler_transaction<A: InboxArm>(arm: A) {
    let s = arm.store();
    let e = event("k");
    let mut tx = s.inbox_begin(bounds()).await.unwrap();
    let outcome = s.inbox_try_insert(&mut tx, &entry(&e, "k")).await.unwrap();
    assert_eq!(outcome, InsertOutcome::Inserted);
    s.inbox_ping().await.unwrap();
    arm.other().inbox_ping().await.unwrap();
    s.inbox_commit(tx).await.unwrap();
    assert_eq!(apply(&arm, s, &e).await, InsertOutcome::AlreadyProcessed);
}

async fn the_retention_sweep_deletes_only_old_processed_rows<A: InboxArm>(arm: A) {
    let s = arm.store();
    let (old1, old2, fresh, failed) = (event("k"), event("k"), event("k"), event("k"));
    for e in [&old1, &old2, &fresh] {
        apply(&arm, s, e).await;
    }
    fail(&arm, s, &failed, "k", 1).await;
    arm.backdate_processed(old1.id, 100).await;
    arm.backdate_processed(old2.id, 100).await;
    let settings = InboxJanitorSettings {
        retention: Duration::from_secs(50),
        batch: 1,
        ..InboxJanitorSettings::default()
    };
    assert_eq!(sweep_inbox(s, &settings).await.unwrap(), 2);
    assert_eq!(sweep_inbox(s, &settings).await.unwrap(), 0);
    // The fresh row is still there (a redelivery is a duplicate), and so is
    // the unprocessed one.
    assert_eq!(
        apply(&arm, s, &fresh).await,
        InsertOutcome::AlreadyProcessed
    );
    let left = s
        .inbox_list_unprocessed(&InboxFilter {
            ids: Some(vec![failed.id]),
            ..InboxFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(left.len(), 1);
}

async fn a_handler_statement_that_failed_is_undone_and_the_attempt_still_recorded<A: InboxArm>(
    arm: A,
) {
    // The handler's own statement fails, which aborts the transaction; the
    // record rolls back to the savepoint, which recovers it, and counts the
    // attempt.
    let e = event("k");
    let s = arm.store();
    let mut tx = s.inbox_begin(bounds()).await.unwrap();
    s.inbox_try_insert(&mut tx, &entry(&e, "k")).await.unwrap();
    s.inbox_savepoint(&mut tx).await.unwrap();
    arm.effect(&mut tx, e.id).await;
    arm.failing_statement(&mut tx).await;
    let r = s
        .inbox_record_failure(&mut tx, &entry(&e, "k"), "division by zero", 3)
        .await
        .unwrap();
    assert_eq!(
        r,
        AttemptRecord {
            attempts: 1,
            dead_lettered: false
        }
    );
    s.inbox_commit(tx).await.unwrap();
    assert_eq!(arm.effects(e.id).await, 0);
    let rows = s
        .inbox_list_unprocessed(&InboxFilter {
            ids: Some(vec![e.id]),
            ..InboxFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].attempts, 1);
}

async fn the_inbox_refuses_what_postgresql_refuses<A: InboxArm>(arm: A) {
    // Envelopes that decode (serde skips unknown fields without judging
    // them) but that PostgreSQL's jsonb will not store; and a routing key
    // with a NUL, which text will not store.
    let e = event("k");
    let with = |extra: &str| {
        let mut body = e.payload.clone();
        body.pop();
        format!("{body},{extra}}}")
    };
    let cases = [
        (with(r#""note":"\u0000""#), "k", true),
        (with(r#""note":"\ud800""#), "k", true),
        (with(r#""note":"\udc00x""#), "k", true),
        (with(r#""note":1e1000000"#), "k", true),
        (with(r#""note":1e-20000"#), "k", true),
        (e.payload.clone(), "k\u{0}", true),
        (with(r#""note":"\ud83d\ude00","n":1e131071"#), "k", false),
        // Nested past any stack PostgreSQL is given (54001), and well within.
        (
            with(&format!(
                r#""note":{}{}"#,
                "[".repeat(20_000),
                "]".repeat(20_000)
            )),
            "k",
            true,
        ),
        (
            with(&format!(
                r#""note":{}{}"#,
                "[".repeat(2_000),
                "]".repeat(2_000)
            )),
            "k",
            false,
        ),
        (e.payload.clone(), "k", false),
    ];
    let s = arm.store();
    for (payload, key, refused) in cases {
        let entry = InboxEntry {
            event_id: e.id,
            subscription: "q",
            routing_key: key,
            payload: payload.as_bytes(),
            fresh_budget: false,
            ordering: None,
        };
        let mut tx = s.inbox_begin(bounds()).await.unwrap();
        let outcome = s.inbox_try_insert(&mut tx, &entry).await;
        s.inbox_rollback(tx).await;
        match outcome {
            Err(StoreError::Refused(_)) if refused => {}
            Ok(InsertOutcome::Inserted) if !refused => {}
            other => panic!("{payload} ({key:?}): {other:?}, refused expected: {refused}"),
        }
    }
}

async fn a_batch_commits_together_and_a_failed_handler_rolls_back_only_its_own_work<A: InboxArm>(
    arm: A,
) {
    // One transaction, three deliveries, each after its own savepoint: the
    // middle one's handler fails (its statement aborts the transaction),
    // which rolls back its own work only; the other two commit with it.
    let (e1, e2, e3) = (event("k"), event("k"), event("k"));
    let s = arm.store();
    let mut tx = s.inbox_begin(bounds()).await.unwrap();
    for e in [&e1, &e2, &e3] {
        assert_eq!(
            s.inbox_try_insert(&mut tx, &entry(e, "k")).await.unwrap(),
            InsertOutcome::Inserted
        );
        s.inbox_savepoint(&mut tx).await.unwrap();
        arm.effect(&mut tx, e.id).await;
        if e.id == e2.id {
            arm.failing_statement(&mut tx).await;
            let r = s
                .inbox_record_failure(&mut tx, &entry(e, "k"), "boom", 3)
                .await
                .unwrap();
            assert_eq!(
                r,
                AttemptRecord {
                    attempts: 1,
                    dead_lettered: false
                }
            );
        } else {
            s.inbox_mark_processed(&mut tx, &entry(e, "k"))
                .await
                .unwrap();
        }
    }
    for e in [&e1, &e2, &e3] {
        assert_eq!(arm.effects(e.id).await, 0, "nothing before the commit");
    }
    s.inbox_commit(tx).await.unwrap();
    assert_eq!(arm.effects(e1.id).await, 1);
    assert_eq!(
        arm.effects(e2.id).await,
        0,
        "the failed handler's work rolled back"
    );
    assert_eq!(arm.effects(e3.id).await, 1);
    for e in [&e1, &e3] {
        assert_eq!(
            apply(&arm, arm.other(), e).await,
            InsertOutcome::AlreadyProcessed
        );
    }
    let rows = s
        .inbox_list_unprocessed(&InboxFilter::default())
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].event_id, rows[0].attempts), (e2.id, 1));
}

async fn a_second_delivery_of_an_event_in_one_transaction_sees_the_first<A: InboxArm>(arm: A) {
    // A batch can hold one event twice (the broker redelivered it): the
    // second sees the row as the transaction left it.
    let (e1, e2, e3) = (event("k"), event("k"), event("k"));
    let s = arm.store();
    assert_eq!(fail(&arm, s, &e3, "k", 5).await.attempts, 1);
    let mut tx = s.inbox_begin(bounds()).await.unwrap();
    // Inserted and processed here: the second delivery is a duplicate.
    assert_eq!(
        s.inbox_try_insert(&mut tx, &entry(&e1, "k")).await.unwrap(),
        InsertOutcome::Inserted
    );
    arm.effect(&mut tx, e1.id).await;
    s.inbox_mark_processed(&mut tx, &entry(&e1, "k"))
        .await
        .unwrap();
    assert_eq!(
        s.inbox_try_insert(&mut tx, &entry(&e1, "k")).await.unwrap(),
        InsertOutcome::AlreadyProcessed
    );
    // Inserted and failed here: the second is a retry that knows the count.
    assert_eq!(
        s.inbox_try_insert(&mut tx, &entry(&e2, "k")).await.unwrap(),
        InsertOutcome::Inserted
    );
    s.inbox_savepoint(&mut tx).await.unwrap();
    let r = s
        .inbox_record_failure(&mut tx, &entry(&e2, "k"), "boom", 2)
        .await
        .unwrap();
    assert_eq!(r.attempts, 1);
    assert_eq!(
        s.inbox_try_insert(&mut tx, &entry(&e2, "k")).await.unwrap(),
        InsertOutcome::InFlightRetry { attempts: 1 }
    );
    s.inbox_savepoint(&mut tx).await.unwrap();
    let r = s
        .inbox_record_failure(&mut tx, &entry(&e2, "k"), "boom", 2)
        .await
        .unwrap();
    assert_eq!(
        r,
        AttemptRecord {
            attempts: 2,
            dead_lettered: true
        }
    );
    // A row committed earlier, locked and processed here.
    assert_eq!(
        s.inbox_try_insert(&mut tx, &entry(&e3, "k")).await.unwrap(),
        InsertOutcome::InFlightRetry { attempts: 1 }
    );
    arm.effect(&mut tx, e3.id).await;
    s.inbox_mark_processed(&mut tx, &entry(&e3, "k"))
        .await
        .unwrap();
    assert_eq!(
        s.inbox_try_insert(&mut tx, &entry(&e3, "k")).await.unwrap(),
        InsertOutcome::AlreadyProcessed
    );
    s.inbox_commit(tx).await.unwrap();
    assert_eq!(arm.effects(e1.id).await, 1);
    assert_eq!(arm.effects(e3.id).await, 1);
    let rows = s
        .inbox_list_unprocessed(&InboxFilter {
            dead_lettered_only: true,
            ..InboxFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].event_id, rows[0].attempts), (e2.id, 2));
}

async fn a_refused_delivery_aborts_its_batch<A: InboxArm>(arm: A) {
    // The inbox refusing one delivery's data aborts the whole transaction
    // (the subscriber rolls it back and runs the rest again without it):
    // later statements fail, and nothing of the batch takes effect.
    let (e1, e2) = (event("k"), event("k"));
    let s = arm.store();
    let mut tx = s.inbox_begin(bounds()).await.unwrap();
    s.inbox_try_insert(&mut tx, &entry(&e1, "k")).await.unwrap();
    arm.effect(&mut tx, e1.id).await;
    s.inbox_mark_processed(&mut tx, &entry(&e1, "k"))
        .await
        .unwrap();
    let bad = InboxEntry {
        routing_key: "k\u{0}",
        ..entry(&e2, "k")
    };
    assert!(matches!(
        s.inbox_try_insert(&mut tx, &bad).await,
        Err(StoreError::Refused(_))
    ));
    assert!(
        s.inbox_try_insert(&mut tx, &entry(&e2, "k")).await.is_err(),
        "the transaction is aborted"
    );
    s.inbox_rollback(tx).await;
    assert_eq!(arm.effects(e1.id).await, 0);
    assert_eq!(apply(&arm, s, &e1).await, InsertOutcome::Inserted);
}

async fn a_new_row_is_processed_with_its_commit_unless_its_handler_failed<A: InboxArm>(arm: A) {
    // The insert marks a new row processed; nothing else is written when
    // the handler succeeds, and a failure record clears the mark.
    let (ok, failed) = (event("k"), event("k"));
    let s = arm.store();
    let mut tx = s.inbox_begin(bounds()).await.unwrap();
    for e in [&ok, &failed] {
        assert_eq!(
            s.inbox_try_insert(&mut tx, &entry(e, "k")).await.unwrap(),
            InsertOutcome::Inserted
        );
        s.inbox_savepoint(&mut tx).await.unwrap();
        arm.effect(&mut tx, e.id).await;
    }
    s.inbox_record_failure(&mut tx, &entry(&failed, "k"), "boom", 3)
        .await
        .unwrap();
    s.inbox_commit(tx).await.unwrap();
    assert_eq!(arm.effects(ok.id).await, 1);
    assert_eq!(
        apply(&arm, arm.other(), &ok).await,
        InsertOutcome::AlreadyProcessed
    );
    let rows = s
        .inbox_list_unprocessed(&InboxFilter::default())
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].event_id, rows[0].attempts), (failed.id, 1));
    assert_eq!(
        apply(&arm, arm.other(), &failed).await,
        InsertOutcome::InFlightRetry { attempts: 1 }
    );
    assert_eq!(arm.effects(failed.id).await, 1);
}

// ---- what real PostgreSQL does that a kind fake would not ------------------

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A fresh transaction of `store` that tries to take `e`'s inbox row:
/// `None` if it still waits after `wait` (it is then given up on and ended).
async fn takes_row<S: InboxStore>(store: &S, e: &Event, wait: Duration) -> Option<InsertOutcome> {
    let mut tx = store.inbox_begin(bounds()).await.unwrap();
    let outcome = tokio::time::timeout(wait, store.inbox_try_insert(&mut tx, &entry(e, "k"))).await;
    store.inbox_rollback(tx).await;
    outcome.ok().map(|o| o.unwrap())
}

async fn a_statement_waiting_on_a_lock_runs_on_after_its_client_gives_up_until_it_is_ended<
    A: InboxArm,
>(
    arm: A,
) {
    let e = event("k");
    let (a, b) = (arm.store(), arm.other());
    arm.hold_domain_lock(true).await;
    let mut tx = a.inbox_begin(bounds()).await.unwrap();
    assert_eq!(
        a.inbox_try_insert(&mut tx, &entry(&e, "k")).await.unwrap(),
        InsertOutcome::Inserted
    );
    // The handler's write waits on the lock, and its client gives up on it
    // (a deadline drops the future).
    let gave_up = tokio::time::timeout(ms(300), arm.try_effect(&mut tx, e.id)).await;
    assert!(gave_up.is_err(), "the write waits on the lock");
    // The server runs it on, inside the transaction that holds the inbox
    // row: another transaction's insert of the event waits on that row.
    assert_eq!(takes_row(b, &e, ms(500)).await, None);
    // Ended at the server, its locks go; the lock it waited on never came.
    a.inbox_abandon(tx).await;
    assert_eq!(
        takes_row(b, &e, Duration::from_secs(3)).await,
        Some(InsertOutcome::Inserted)
    );
    arm.hold_domain_lock(false).await;
    assert_eq!(arm.effects(e.id).await, 0);
}

async fn statement_and_lock_timeouts_end_a_wait_with_their_sqlstates<A: InboxArm>(arm: A) {
    let (e, f) = (event("k"), event("k"));
    let a = arm.store();
    arm.hold_domain_lock(true).await;
    let short = TxBounds {
        idle: Duration::from_secs(60),
        statement: ms(400),
    };
    let mut tx = a.inbox_begin(short).await.unwrap();
    a.inbox_try_insert(&mut tx, &entry(&e, "k")).await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(5), arm.try_effect(&mut tx, e.id))
        .await
        .expect("statement_timeout ends the wait");
    let err = ended.unwrap_err();
    assert!(
        err.is_unavailable() && err.message().contains("statement timeout"),
        "{err}"
    );
    a.inbox_rollback(tx).await;

    let mut tx = a.inbox_begin(bounds()).await.unwrap();
    a.inbox_try_insert(&mut tx, &entry(&f, "k")).await.unwrap();
    arm.set_lock_timeout(&mut tx, 300).await;
    let ended = tokio::time::timeout(Duration::from_secs(5), arm.try_effect(&mut tx, f.id))
        .await
        .expect("lock_timeout ends the wait");
    let err = ended.unwrap_err();
    assert!(
        err.is_unavailable() && err.message().contains("lock timeout"),
        "{err}"
    );
    a.inbox_rollback(tx).await;
    arm.hold_domain_lock(false).await;
    assert_eq!(arm.effects(e.id).await + arm.effects(f.id).await, 0);
}

async fn a_statement_cancelled_from_another_session_fails_its_transaction<A: InboxArm>(arm: A) {
    let e = event("k");
    let a = arm.store();
    arm.hold_domain_lock(true).await;
    let mut tx = a.inbox_begin(bounds()).await.unwrap();
    a.inbox_try_insert(&mut tx, &entry(&e, "k")).await.unwrap();
    let tag = A::tag(&tx);
    let cancel = async {
        tokio::time::sleep(ms(300)).await;
        arm.cancel(&tag).await;
    };
    let (written, ()) = futures_lite::future::zip(arm.try_effect(&mut tx, e.id), cancel).await;
    let err = written.unwrap_err();
    assert!(
        err.is_unavailable() && err.message().contains("user request"),
        "{err}"
    );
    // The transaction is aborted: the check says so.
    assert!(!a.inbox_check(&mut tx).await.unwrap_err().is_unavailable());
    a.inbox_rollback(tx).await;
    arm.hold_domain_lock(false).await;
}

async fn a_transaction_idle_past_its_bound_is_ended_by_the_server<A: InboxArm>(arm: A) {
    let e = event("k");
    let (a, b) = (arm.store(), arm.other());
    let short = TxBounds {
        idle: ms(300),
        statement: Duration::from_secs(5),
    };
    let mut tx = a.inbox_begin(short).await.unwrap();
    a.inbox_try_insert(&mut tx, &entry(&e, "k")).await.unwrap();
    tokio::time::sleep(ms(900)).await;
    // Its row lock went with the session.
    assert_eq!(
        takes_row(b, &e, Duration::from_secs(2)).await,
        Some(InsertOutcome::Inserted)
    );
    let err = arm.try_effect(&mut tx, e.id).await.unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    a.inbox_rollback(tx).await;
}

async fn a_deferred_constraint_fails_at_the_check_or_at_the_commit<A: InboxArm>(arm: A) {
    let (e1, e2, e3) = (event("k"), event("k"), event("k"));
    let a = arm.store();
    let key = "unique.k";
    let mut tx = a.inbox_begin(bounds()).await.unwrap();
    a.inbox_try_insert(&mut tx, &entry(&e1, "k")).await.unwrap();
    arm.keyed_effect(&mut tx, e1.id, key).await.unwrap();
    a.inbox_check(&mut tx).await.unwrap();
    a.inbox_commit(tx).await.unwrap();

    // The write itself passes (the constraint is deferred); the check fails
    // on the deliveries' data, not for the database's availability; undone
    // to its savepoint, the transaction can commit the failure record.
    let mut tx = a.inbox_begin(bounds()).await.unwrap();
    a.inbox_try_insert(&mut tx, &entry(&e2, "k")).await.unwrap();
    a.inbox_savepoint(&mut tx).await.unwrap();
    arm.keyed_effect(&mut tx, e2.id, key).await.unwrap();
    let err = a.inbox_check(&mut tx).await.unwrap_err();
    assert!(!err.is_unavailable(), "{err}");
    a.inbox_undo_handler(&mut tx).await.unwrap();
    a.inbox_check(&mut tx).await.unwrap();
    let record = a
        .inbox_record_failure(&mut tx, &entry(&e2, "k"), "key taken", 3)
        .await
        .unwrap();
    assert_eq!(record.attempts, 1);
    a.inbox_commit(tx).await.unwrap();

    // A check passed leaves the constraint deferred (later work is not held
    // to it early), and without a check the COMMIT fails and keeps nothing.
    let mut tx = a.inbox_begin(bounds()).await.unwrap();
    a.inbox_try_insert(&mut tx, &entry(&e3, "k")).await.unwrap();
    a.inbox_check(&mut tx).await.unwrap();
    arm.keyed_effect(&mut tx, e3.id, key).await.unwrap();
    let err = a.inbox_commit(tx).await.unwrap_err();
    assert!(!err.is_unavailable(), "{err}");
    assert_eq!(arm.effects(e1.id).await, 1);
    assert_eq!(arm.effects(e2.id).await + arm.effects(e3.id).await, 0);
    assert_eq!(apply(&arm, a, &e3).await, InsertOutcome::Inserted);
}

async fn an_aborted_transaction_commits_nothing_and_says_nothing<A: InboxArm>(arm: A) {
    let (e, f) = (event("k"), event("k"));
    let a = arm.store();
    // A handler statement fails and the handler swallows the error.
    let mut tx = a.inbox_begin(bounds()).await.unwrap();
    a.inbox_try_insert(&mut tx, &entry(&e, "k")).await.unwrap();
    arm.effect(&mut tx, e.id).await;
    arm.failing_statement(&mut tx).await;
    // The COMMIT answers like a successful one...
    a.inbox_commit(tx).await.unwrap();
    // ...and nothing committed: not the effect, not the inbox row.
    assert_eq!(arm.effects(e.id).await, 0);
    assert_eq!(apply(&arm, a, &e).await, InsertOutcome::Inserted);
    // The check is what tells.
    let mut tx = a.inbox_begin(bounds()).await.unwrap();
    a.inbox_try_insert(&mut tx, &entry(&f, "k")).await.unwrap();
    arm.failing_statement(&mut tx).await;
    let err = a.inbox_check(&mut tx).await.unwrap_err();
    assert!(!err.is_unavailable(), "{err}");
    a.inbox_rollback(tx).await;
}

async fn a_listing_resumes_after_its_cursor<A: InboxArm>(arm: A) {
    let a = arm.store();
    let events: Vec<Event> = (0..3).map(|_| event("k")).collect();
    for e in &events {
        fail(&arm, a, e, "k", 1).await;
    }
    let list = |after, limit| InboxFilter {
        dead_lettered_only: true,
        limit: Some(limit),
        after,
        ..InboxFilter::default()
    };
    let all = a.inbox_list_unprocessed(&list(None, 10)).await.unwrap();
    assert_eq!(all.len(), 3);
    let first = a.inbox_list_unprocessed(&list(None, 1)).await.unwrap();
    let cursor = outbox::admin::InboxCursor::of(&first[0]);
    let rest = a
        .inbox_list_unprocessed(&list(Some(cursor), 10))
        .await
        .unwrap();
    let ids =
        |rows: &[outbox::admin::InboxRow]| rows.iter().map(|r| r.event_id).collect::<Vec<_>>();
    assert_eq!(
        ids(&rest),
        ids(&all[1..]),
        "strictly after the cursor, in order"
    );
    let last = outbox::admin::InboxCursor::of(&all[2]);
    assert!(
        a.inbox_list_unprocessed(&list(Some(last), 10))
            .await
            .unwrap()
            .is_empty()
    );
}

/// A listing matches a field of the event's payload in the database (a
/// string as itself; anything else as JSON, numbers by value), and can
/// leave every row's payload out.
async fn a_listing_matches_a_payload_field_and_can_leave_payloads_out<A: InboxArm>(arm: A) {
    let a = arm.store();
    let make = |payload: serde_json::Value| {
        let e = EventEnvelope::new("k", payload);
        Event {
            id: e.id,
            payload: e.encode(&Default::default()).unwrap(),
        }
    };
    let events = [
        make(serde_json::json!({ "customer": { "id": 42 }, "lines": [{ "sku": "a" }] })),
        make(serde_json::json!({ "customer": { "id": "42" } })),
        make(serde_json::json!({ "customer": { "id": 42.0 } })),
        make(serde_json::json!({ "customer": { "id": 7 }, "lines": [{ "sku": "b" }] })),
        make(serde_json::json!({ "customer": { "id": "\"42\"" } })),
    ];
    for e in &events {
        fail(&arm, a, e, "k", 1).await;
    }
    let list = |path: &str, value: &str| InboxFilter {
        dead_lettered_only: true,
        payload_field: Some(outbox::core::ports::PayloadField::dotted(path, value)),
        ..InboxFilter::default()
    };
    let ids =
        |rows: &[outbox::admin::InboxRow]| rows.iter().map(|r| r.event_id).collect::<Vec<_>>();
    let found = |f| async move { ids(&a.inbox_list_unprocessed(&f).await.unwrap()) };
    assert_eq!(
        found(list("customer.id", "42")).await,
        [events[0].id, events[1].id, events[2].id],
        "the string itself, and the number by value"
    );
    assert_eq!(found(list("customer.id", "\"42\"")).await, [events[4].id]);
    assert_eq!(found(list("lines.0.sku", "b")).await, [events[3].id]);
    assert!(found(list("lines.1.sku", "a")).await.is_empty());
    assert!(found(list("customer.id.deeper", "42")).await.is_empty());
    assert!(found(list("customer", "42")).await.is_empty());
    // Without payloads: the same rows, every payload empty.
    let with = a
        .inbox_list_unprocessed(&InboxFilter {
            dead_lettered_only: true,
            ..InboxFilter::default()
        })
        .await
        .unwrap();
    let without = a
        .inbox_list_unprocessed(&InboxFilter {
            dead_lettered_only: true,
            omit_payload: true,
            ..InboxFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(ids(&with), ids(&without));
    assert!(with.iter().all(|r| !r.payload.is_empty()));
    assert!(without.iter().all(|r| r.payload.is_empty()));
    assert_eq!(
        without
            .iter()
            .map(|r| (r.attempts, r.dead_lettered_at))
            .collect::<Vec<_>>(),
        with.iter()
            .map(|r| (r.attempts, r.dead_lettered_at))
            .collect::<Vec<_>>()
    );
}

/// One failed attempt of an ordered delivery (see [`fail`]).
async fn fail_keyed<A: InboxArm>(
    arm: &A,
    e: &Event,
    o: &outbox::core::ports::KeySeq,
    max_attempts: u32,
) {
    let store = arm.store();
    let entry = keyed(e, o);
    let mut tx = begin_for(store, &entry).await;
    assert_eq!(
        store.inbox_try_insert(&mut tx, &entry).await.unwrap(),
        InsertOutcome::Inserted
    );
    store.inbox_savepoint(&mut tx).await.unwrap();
    store
        .inbox_record_failure(&mut tx, &entry, "boom", max_attempts)
        .await
        .unwrap();
    store.inbox_commit(tx).await.unwrap();
}

async fn an_ordered_delivery_behind_a_retrying_event_of_its_key_waits_behind_it<A: InboxArm>(
    arm: A,
) {
    let a = arm.store();
    let (e1, e2, other) = (event("k"), event("k"), event("k"));
    let (k1, k2) = (ks("acct-1", 1), ks("acct-1", 2));
    fail_keyed(&arm, &e1, &k1, 5).await;
    assert_eq!(
        insert_only(a, &keyed(&e2, &k2)).await,
        InsertOutcome::BehindRetry
    );
    // Another key, and an unordered entry, are not held back.
    let k9 = ks("acct-9", 4);
    assert_eq!(
        apply_entry(&arm, a, &keyed(&other, &k9)).await,
        InsertOutcome::Inserted
    );
    let rows = a
        .inbox_list_unprocessed(&InboxFilter {
            subscription: Some("q".into()),
            ..InboxFilter::default()
        })
        .await
        .unwrap();
    // The deferred delivery's row records that it waits: unprocessed, no
    // attempt, not held.
    assert_eq!(rows.len(), 2, "{rows:?}");
    let waiting = rows.iter().find(|r| r.event_id == e2.id).expect("its row");
    assert_eq!(waiting.ordering, Some(k2.clone()));
    assert_eq!((waiting.attempts, waiting.held), (0, false));
    assert!(waiting.dead_lettered_at.is_none());
    // A number after it waits behind it too (a handover's redelivery may
    // bring number 3 before 2 comes back).
    let (e3, k3) = (event("k"), ks("acct-1", 3));
    assert_eq!(
        insert_only(a, &keyed(&e3, &k3)).await,
        InsertOutcome::BehindRetry
    );
    assert_eq!(
        insert_only(a, &keyed(&e2, &k2)).await,
        InsertOutcome::BehindRetry
    );
    // The retry takes effect; then the next ones go in, in order.
    assert_eq!(
        apply_entry(&arm, a, &keyed(&e1, &k1)).await,
        InsertOutcome::InFlightRetry { attempts: 1 }
    );
    assert_eq!(
        insert_only(a, &keyed(&e3, &k3)).await,
        InsertOutcome::BehindRetry
    );
    assert_eq!(
        apply_entry(&arm, a, &keyed(&e2, &k2)).await,
        InsertOutcome::InFlightRetry { attempts: 0 }
    );
    assert_eq!(
        apply_entry(&arm, a, &keyed(&e3, &k3)).await,
        InsertOutcome::InFlightRetry { attempts: 0 }
    );
}

async fn a_delivery_behind_a_dead_lettered_event_is_held_until_skipped<A: InboxArm>(arm: A) {
    let a = arm.store();
    let es: Vec<Event> = (0..4).map(|_| event("k")).collect();
    let k: Vec<outbox::core::ports::KeySeq> = (1..=4).map(|n| ks("acct-1", n)).collect();
    fail_keyed(&arm, &es[0], &k[0], 1).await;
    // Numbers 3 then 2 arrive (a handover's redelivery order): both held.
    assert_eq!(
        insert_only(a, &keyed(&es[2], &k[2])).await,
        InsertOutcome::Held
    );
    assert_eq!(
        insert_only(a, &keyed(&es[1], &k[1])).await,
        InsertOutcome::Held
    );
    // A redelivery of a held row is held again, and a held row blocks.
    assert_eq!(
        insert_only(a, &keyed(&es[2], &k[2])).await,
        InsertOutcome::Held
    );
    assert_eq!(
        insert_only(a, &keyed(&es[3], &k[3])).await,
        InsertOutcome::Held
    );
    let held = a.inbox_held("q", "acct-1", 1, 10).await.unwrap();
    let seqs: Vec<i64> = held
        .iter()
        .map(|r| r.ordering.as_ref().unwrap().seq)
        .collect();
    assert_eq!(seqs, [2, 3, 4], "in the key's order");
    assert!(held.iter().all(|r| r.held && r.dead_lettered_at.is_none()));
    assert_eq!(a.inbox_held("q", "acct-1", 3, 10).await.unwrap().len(), 1);
    assert!(a.inbox_held("q", "acct-2", 0, 10).await.unwrap().is_empty());
    assert!(
        a.inbox_held("other", "acct-1", 0, 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        a.inbox_releasable("q", 10).await.unwrap().is_empty(),
        "the dead-lettered head holds them"
    );
    // Skipping a row that is not dead-lettered does nothing.
    assert!(a.inbox_skip("q", &[es[1].id]).await.unwrap().is_empty());
    let skipped = a.inbox_skip("q", &[es[0].id, es[0].id]).await.unwrap();
    assert_eq!(skipped.len(), 1);
    assert_eq!(skipped[0].event_id, es[0].id);
    assert_eq!(skipped[0].ordering, Some(k[0].clone()));
    assert_eq!(arm.effects(es[0].id).await, 0, "skipped: no effect");
    assert!(
        a.inbox_skip("q", &[es[0].id]).await.unwrap().is_empty(),
        "once"
    );
    let free = a.inbox_releasable("q", 10).await.unwrap();
    assert_eq!(
        free.len(),
        1,
        "the key's lowest held row, nothing before it"
    );
    assert_eq!(free[0].event_id, es[1].id);
    // Released: a replay of number 2 takes effect; 3 then goes on.
    assert_eq!(
        reset(a, &keyed(&es[1], &k[1])).await,
        InsertOutcome::InFlightRetry { attempts: 0 }
    );
    assert_eq!(
        apply_entry(&arm, a, &keyed(&es[1], &k[1])).await,
        InsertOutcome::InFlightRetry { attempts: 0 }
    );
    let free = a.inbox_releasable("q", 10).await.unwrap();
    assert_eq!(
        free.iter().map(|r| r.event_id).collect::<Vec<_>>(),
        [es[2].id]
    );
}

async fn one_keys_deliveries_take_its_lock_one_transaction_at_a_time<A: InboxArm>(arm: A) {
    let (a, b) = (arm.store(), arm.other());
    let (e1, e2) = (event("k"), event("k"));
    let (k1, k2) = (ks("acct-1", 1), ks("acct-1", 2));
    let mut tx = begin_for(a, &keyed(&e1, &k1)).await;
    assert_eq!(
        a.inbox_try_insert(&mut tx, &keyed(&e1, &k1)).await.unwrap(),
        InsertOutcome::Inserted
    );
    a.inbox_savepoint(&mut tx).await.unwrap();
    // Another key's delivery goes on meanwhile.
    let k9 = ks("acct-9", 1);
    let other = event("k");
    assert_eq!(
        insert_only(b, &keyed(&other, &k9)).await,
        InsertOutcome::Inserted
    );
    // The same key's next delivery waits for the first transaction.
    let mut tx2 = b.inbox_begin(bounds()).await.unwrap();
    let waited = tokio::time::timeout(ms(400), b.inbox_lock_keys(&mut tx2, "q", &["acct-1"])).await;
    assert!(waited.is_err(), "waits on the key's lock");
    b.inbox_abandon(tx2).await;
    let record = a
        .inbox_record_failure(&mut tx, &keyed(&e1, &k1), "boom", 1)
        .await
        .unwrap();
    assert!(record.dead_lettered);
    let waiting = async {
        let mut tx2 = begin_for(b, &keyed(&e2, &k2)).await;
        let outcome = b
            .inbox_try_insert(&mut tx2, &keyed(&e2, &k2))
            .await
            .unwrap();
        b.inbox_commit(tx2).await.unwrap();
        outcome
    };
    let commit = async {
        tokio::time::sleep(ms(200)).await;
        a.inbox_commit(tx).await.unwrap();
    };
    let (outcome, ()) = tokio::join!(waiting, commit);
    assert_eq!(
        outcome,
        InsertOutcome::Held,
        "it saw what the first committed"
    );
}

/// Two transactions locking overlapping sets of keys: the second waits
/// for the first's end, not for ever (all take them in one order), and
/// keys listed twice or in any order are locked once.
async fn key_locks_of_overlapping_sets_wait_for_each_other_and_never_deadlock<A: InboxArm>(arm: A) {
    let (a, b) = (arm.store(), arm.other());
    let mut first = a.inbox_begin(bounds()).await.unwrap();
    a.inbox_lock_keys(&mut first, "q", &["k-2", "k-1", "k-2"])
        .await
        .unwrap();
    // Another subscription's key of the same name is another lock.
    let mut elsewhere = b.inbox_begin(bounds()).await.unwrap();
    tokio::time::timeout(ms(2_000), b.inbox_lock_keys(&mut elsewhere, "q2", &["k-1"]))
        .await
        .expect("another subscription's key does not wait")
        .unwrap();
    b.inbox_rollback(elsewhere).await;
    let took = std::sync::atomic::AtomicBool::new(false);
    let second = async {
        let mut tx = b.inbox_begin(bounds()).await.unwrap();
        b.inbox_lock_keys(&mut tx, "q", &["k-3", "k-1"])
            .await
            .unwrap();
        took.store(true, std::sync::atomic::Ordering::SeqCst);
        b.inbox_commit(tx).await.unwrap();
    };
    let first_ends = async {
        tokio::time::sleep(ms(300)).await;
        assert!(
            !took.load(std::sync::atomic::Ordering::SeqCst),
            "the second waits: the first holds k-1"
        );
        // It takes more of its own meanwhile, k-3 aside.
        a.inbox_lock_keys(&mut first, "q", &["k-1", "k-4"])
            .await
            .unwrap();
        a.inbox_commit(first).await.unwrap();
    };
    tokio::time::timeout(ms(5_000), async { tokio::join!(second, first_ends) })
        .await
        .expect("the second took its keys once the first ended");
}

/// As [`with_real`], on the partitioned layout (a partition a second).
async fn with_real_partitioned<F, Fut>(pool: PgPool, body: F)
where
    F: FnOnce(Real) -> Fut,
    Fut: Future<Output = ()>,
{
    outbox::migrate::partition(&pool, Some(Duration::from_secs(1)))
        .await
        .unwrap();
    with_real(pool, body).await;
}

/// The partitioned layout's inbox retention (issue 28): a closed partition
/// whose rows are all processed and past retention goes whole; one holding
/// an unprocessed (failing) row stays, and the row sweep takes its expired
/// rows. On the plain layout the pass does nothing and says so.
async fn inbox_partitions_go_once_every_row_expired<A: InboxArm>(arm: A) {
    let s = arm.store();
    let older = Duration::from_secs(50);
    let first = s.inbox_retire_partitions(older).await.unwrap();
    if !first.partitioned {
        assert_eq!(first, outbox::core::ports::PartitionsRetired::default());
        return;
    }
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let ahead = s.inbox_retire_partitions(older).await.unwrap();
    assert!(!ahead.created.is_empty(), "{ahead:?}");
    let t = arm.id_now_ms();
    let at = |ms: u64, n: u8| {
        let mut e = EventEnvelope::new("k", serde_json::json!({ "n": n }));
        e.id = uuid::Builder::from_unix_timestamp_millis(ms, &[n; 10]).into_uuid();
        Event {
            id: e.id,
            payload: e.encode(&Default::default()).unwrap(),
        }
    };
    let (a1, a2, c, d) = (at(t, 1), at(t, 2), at(t + 1_000, 3), at(t + 1_000, 4));
    for e in [&a1, &a2, &c] {
        apply(&arm, s, e).await;
    }
    fail(&arm, s, &d, "k", 5).await;
    for e in [&a1, &a2, &c] {
        arm.backdate_processed(e.id, 100).await;
    }
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    let retired = s.inbox_retire_partitions(older).await.unwrap();
    assert!(!retired.dropped.is_empty(), "{retired:?}");
    assert_eq!(
        s.inbox_delete_processed(older, 10).await.unwrap(),
        1,
        "c, from the held partition"
    );
    let left = s
        .inbox_list_unprocessed(&InboxFilter::default())
        .await
        .unwrap();
    assert_eq!(left.iter().map(|r| r.event_id).collect::<Vec<_>>(), [d.id]);
    // The dropped and deleted rows are gone: a redelivery is new again.
    assert_eq!(apply(&arm, s, &a1).await, InsertOutcome::Inserted);
    assert_eq!(apply(&arm, s, &c).await, InsertOutcome::Inserted);
}

conformance!(postgres: with_real, fake: with_fake,
    partitioned: with_real_partitioned, with_fake_partitioned;
    inbox_partitions_go_once_every_row_expired,

    key_locks_of_overlapping_sets_wait_for_each_other_and_never_deadlock,
    an_ordered_delivery_behind_a_retrying_event_of_its_key_waits_behind_it,
    a_delivery_behind_a_dead_lettered_event_is_held_until_skipped,
    one_keys_deliveries_take_its_lock_one_transaction_at_a_time,

    a_committed_event_is_already_processed_the_second_time,
    two_subscriptions_each_take_an_events_effect,
    the_counts_say_what_was_processed_recently_is_retried_and_dead_lettered,
    a_replays_fresh_budget_takes_effect_only_with_its_commit,
    a_fresh_budget_resets_a_dead_lettered_row_only,
    a_rolled_back_attempt_leaves_only_its_recorded_failure,
    a_concurrent_delivery_waits_for_the_first_and_sees_its_outcome,
    replay_listing_filters_orders_and_resets_the_budget,
    the_retention_sweep_deletes_only_old_processed_rows,
    the_inbox_refuses_what_postgresql_refuses,
    a_handler_statement_that_failed_is_undone_and_the_attempt_still_recorded,
    a_batch_commits_together_and_a_failed_handler_rolls_back_only_its_own_work,
    a_second_delivery_of_an_event_in_one_transaction_sees_the_first,
    a_refused_delivery_aborts_its_batch,
    a_new_row_is_processed_with_its_commit_unless_its_handler_failed,
    a_ping_answers_beside_an_open_handler_transaction,
    a_statement_waiting_on_a_lock_runs_on_after_its_client_gives_up_until_it_is_ended,
    statement_and_lock_timeouts_end_a_wait_with_their_sqlstates,
    a_statement_cancelled_from_another_session_fails_its_transaction,
    a_transaction_idle_past_its_bound_is_ended_by_the_server,
    a_deferred_constraint_fails_at_the_check_or_at_the_commit,
    an_aborted_transaction_commits_nothing_and_says_nothing,
    a_listing_resumes_after_its_cursor,
    a_listing_matches_a_payload_field_and_can_leave_payloads_out,
);
