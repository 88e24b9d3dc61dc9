//! The durability gates' cost (`--only gates`, against the primary of
//! `.ci/pg-pair`: `--database-url postgres://postgres@127.0.0.1:5441/postgres`):
//! P1 (one drainer) and P7 (the subscriber at defaults) with
//! `CANOPY_MQ_DURABLE_STANDBYS=pg2` against without, in the same run, and
//! synchronous replication without the gates as the contrast.

use sqlx::{Executor, PgPool};

use super::sections::Sheet;
use super::{drain, p7_applied_table, p7_fill, p7_settings, p7_subscribe, p7_topology, purge};
use benches::{envelope, prefill};

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The standby the pair streams to.
const STANDBY: &str = "pg2";

/// Makes the primary wait for `pg2` at every commit, or not.
async fn synchronous(pool: &PgPool, on: bool) -> BoxResult<()> {
    pool.execute(if on {
        "ALTER SYSTEM SET synchronous_standby_names = 'pg2'"
    } else {
        "ALTER SYSTEM SET synchronous_standby_names = ''"
    })
    .await?;
    pool.execute("SELECT pg_reload_conf()").await?;
    // The setting reaches the sessions at their next command.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    Ok(())
}

/// One drain of `n` rows and one subscriber run over `n` deliveries:
/// (rows/s, events/s).
async fn both(s: &Sheet<'_>, standbys: &[String]) -> BoxResult<(f64, f64)> {
    let n = s.n;
    prefill(&s.pool, n).await?;
    let p1 = drain(&s.pool, &s.args.amqp_url, n, 1, standbys).await?;
    purge(&s.conn).await?;
    let fresh: Vec<_> = (0..n).map(envelope).collect();
    p7_fill(&s.conn, &fresh, None).await?;
    let (p7, _) = p7_subscribe(
        &s.pool,
        &s.args.amqp_url,
        n as u64,
        p7_settings(None, None),
        0,
        standbys,
    )
    .await?;
    s.pool.execute("TRUNCATE event_inbox, p7_applied").await?;
    Ok((p1.rows_per_sec, p7))
}

/// The gates on against off, and synchronous replication.
pub async fn section(s: &mut Sheet<'_>) -> BoxResult<()> {
    let streams: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_stat_replication WHERE application_name = $1")
            .bind(STANDBY)
            .fetch_one(&s.pool)
            .await?;
    if streams == 0 {
        return Err(format!(
            "gates: no standby {STANDBY} streams from this server; run against the primary \
             of `.ci/pg-pair start`"
        )
        .into());
    }
    p7_applied_table(&s.pool).await?;
    p7_topology(&s.args.amqp_url, true, None).await?;
    let gated = [STANDBY.to_owned()];
    let n = s.n;
    eprintln!("gates: P1 and P7 over {n} events, gates off, on, and synchronous ...");
    let (p1_off, p7_off) = both(s, &[]).await?;
    let (p1_on, p7_on) = both(s, &gated).await?;
    synchronous(&s.pool, true).await?;
    let sync = both(s, &[]).await;
    synchronous(&s.pool, false).await?;
    let (p1_sync, p7_sync) = sync?;
    p7_topology(&s.args.amqp_url, false, None).await?;
    for (what, off, on, sync, unit) in [
        ("P1 drain, 1 replica", p1_off, p1_on, p1_sync, "rows/s"),
        (
            "P7 subscriber, defaults",
            p7_off,
            p7_on,
            p7_sync,
            "events/s",
        ),
    ] {
        s.row(format!(
            "| {what}, gates on ({STANDBY}) against off ({off:.0} {unit}), asynchronous standby | {on:.0} {unit} | {:.2}× off | ≥ 0.8× |",
            on / off
        ));
        s.row(format!(
            "| {what}, synchronous standby, gates off | {sync:.0} {unit} | {:.2}× off | contrast |",
            sync / off
        ));
    }
    s.key("gates_p1_on_vs_off", p1_on / p1_off);
    s.key("gates_p7_on_vs_off", p7_on / p7_off);
    s.key("gates_p1_sync_vs_off", p1_sync / p1_off);
    s.key("gates_p7_sync_vs_off", p7_sync / p7_off);
    Ok(())
}
