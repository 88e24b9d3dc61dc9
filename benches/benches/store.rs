//! The database side of the outbox on the local PostgreSQL, in its own
//! database (`outbox_bench`, dropped and recreated):
//!
//! - `publish`: one domain transaction (an `orders` row) alone, with
//!   `publish_tx` of 1 envelope, and with `publish_many_tx` of 100: the
//!   first is the baseline for the other two (P4 of issue 5);
//! - `claim_mark`: the drainer's Phase 1 claim of 100 rows plus the Phase 3
//!   mark of them, at backlogs of 1 000, 10 000 and 100 000 unpublished rows
//!   (P2: the cost should not grow with the backlog). Each iteration's rows
//!   are put back (untimed), so the backlog stays the same size.
//!
//! `cargo bench -p benches --bench store` (needs `DATABASE_URL`; the
//! workspace's `.cargo/config.toml` points it at the local server).

use std::time::{Duration, Instant};

use benches::{claim_and_mark, envelope, fresh_database, prefill};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use outbox::{EventEnvelope, PgOutboxStore, Publisher};
use sqlx::{Executor, PgPool};

const DATABASE: &str = "outbox_bench";

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

fn database(rt: &tokio::runtime::Runtime) -> PgPool {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    rt.block_on(fresh_database(&url, DATABASE, 4))
        .unwrap_or_else(|e| panic!("store bench needs PostgreSQL: {e}"))
}

fn publish(c: &mut Criterion) {
    let rt = runtime();
    let pool = database(&rt);
    let publisher = Publisher::new(pool.clone());
    let mut group = c.benchmark_group("publish");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(4));
    let mut order = 0i64;
    for (name, envelopes) in [
        ("domain_tx_alone", 0usize),
        ("publish_tx_1", 1),
        ("publish_many_tx_100", 100),
    ] {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        order += 1;
                        let batch: Vec<EventEnvelope> = (0..envelopes)
                            .map(|k| envelope(order as usize * 100 + k))
                            .collect();
                        let t = Instant::now();
                        let mut tx = pool.begin().await.expect("begin");
                        sqlx::query("INSERT INTO orders (id, note) VALUES ($1, 'bench')")
                            .bind(order)
                            .execute(&mut *tx)
                            .await
                            .expect("domain insert");
                        match batch.as_slice() {
                            [] => {}
                            [one] => publisher
                                .publish_tx(&mut tx, one)
                                .await
                                .expect("publish_tx"),
                            many => publisher
                                .publish_many_tx(&mut tx, many)
                                .await
                                .expect("publish_many_tx"),
                        }
                        tx.commit().await.expect("commit");
                        spent += t.elapsed();
                    }
                    spent
                })
            })
        });
    }
    group.finish();
    rt.block_on(async {
        pool.execute("TRUNCATE event_outbox, orders")
            .await
            .expect("truncate");
        pool.close().await;
    });
}

fn claim_mark(c: &mut Criterion) {
    let rt = runtime();
    let pool = database(&rt);
    let store = PgOutboxStore::new(pool.clone());
    let mut group = c.benchmark_group("claim_mark");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(4));
    group.throughput(Throughput::Elements(100));
    let mut filled = 0;
    // Under `cargo test` (no `--bench`) each benchmark runs once: the
    // smallest backlog proves the bench works without the long prefill.
    let measuring = std::env::args().any(|a| a == "--bench");
    let backlogs: &[usize] = if measuring {
        &[1_000, 10_000, 100_000]
    } else {
        &[1_000]
    };
    for &backlog in backlogs {
        rt.block_on(prefill(&pool, backlog - filled))
            .expect("prefill");
        filled = backlog;
        group.bench_function(format!("backlog_{backlog}"), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        let t = Instant::now();
                        let (ids, marked) = claim_and_mark(&store, "bench")
                            .await
                            .expect("claim and mark");
                        spent += t.elapsed();
                        assert_eq!(marked, 100, "the backlog ran dry");
                        // Untimed: the rows go back to the end of the backlog.
                        sqlx::query(
                            "UPDATE event_outbox SET published_at = NULL, claimed_at = NULL, \
                             claimed_by = NULL, enqueued_at = clock_timestamp() WHERE id = ANY($1)",
                        )
                        .bind(&ids)
                        .execute(&pool)
                        .await
                        .expect("put back");
                    }
                    spent
                })
            })
        });
    }
    group.finish();
    rt.block_on(async {
        pool.execute("TRUNCATE event_outbox")
            .await
            .expect("truncate");
        pool.close().await;
    });
}

criterion_group!(benches, publish, claim_mark);
criterion_main!(benches);
