//! The simulation's fuzz properties (`fuzz/props/sim.rs`) on stable, over
//! every committed input of their targets (`fuzz/props/replay.rs`): the
//! scenario loader, and the fake's `jsonb` against the local PostgreSQL.

#[path = "../../fuzz/props/sim.rs"]
mod props;
#[path = "../../fuzz/props/replay.rs"]
mod replay;

use replay::replay;
use sqlx::{Connection, PgConnection};

#[test]
fn scenario_corpus() {
    replay("scenario", props::scenario);
}
#[test]
fn jsonb_corpus_agrees_with_postgresql() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let conn = std::cell::RefCell::new(rt.block_on(PgConnection::connect(&url)).unwrap());
    let ask = |text: &str| props::ask_postgres(&rt, &mut conn.borrow_mut(), text);
    replay("jsonb", |data| props::jsonb(data, ask));
}
