#![no_main]
//! `props::jsonb` under libFuzzer: the fake's `jsonb` against the local
//! PostgreSQL's (`DATABASE_URL`, default the local server), one query per
//! input on one connection.

#[path = "../props/sim.rs"]
#[allow(dead_code)]
mod props;

use std::sync::OnceLock;

use sqlx::{Connection, PgConnection};
use tokio::runtime::Runtime;

struct Pg {
    rt: Runtime,
    conn: std::sync::Mutex<PgConnection>,
}

fn pg() -> &'static Pg {
    static PG: OnceLock<Pg> = OnceLock::new();
    PG.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let conn = rt
            .block_on(PgConnection::connect(&url))
            .expect("the local PostgreSQL (DATABASE_URL)");
        Pg {
            rt,
            conn: std::sync::Mutex::new(conn),
        }
    })
}

fn ask(text: &str) -> props::PgVerdict {
    let pg = pg();
    let mut conn = pg.conn.lock().expect("the connection");
    props::ask_postgres(&pg.rt, &mut conn, text)
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::jsonb(data, ask));
