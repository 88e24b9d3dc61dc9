//! The harness's sections, one function each: what `--only` names. Each
//! measures on the real services, then adds its rows to the table of docs/internals/performance.md
//! and its flat keys to `target/harness.json`.

use lapin::Connection;
use outbox::QueueType;
use serde_json::{Map, Value, json};
use sqlx::PgPool;

use super::{
    Args, DEPTH, antipattern, ceiling, ceiling_beside_database, claim_scaling, drain, end_to_end,
    ms, p3, p7, p9, p9_failing, p9_subscriber, p10, phases, prefill, publish_cost, purge, sink,
};

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

/// One harness run: the services, the ceiling every ratio is taken
/// against, and what the sections wrote.
pub struct Sheet<'a> {
    pub args: &'a Args,
    pub pool: PgPool,
    pub conn: Connection,
    pub n: usize,
    pub ceiling: f64,
    /// P1's one-replica rate, for the sections that compare with it.
    pub p1_rate: Option<f64>,
    pub table: Vec<String>,
    pub json: Map<String, Value>,
}

impl<'a> Sheet<'a> {
    /// Measures the ceiling (raw publish + confirm) every ratio needs.
    pub async fn new(args: &'a Args, pool: PgPool, conn: Connection) -> BoxResult<Self> {
        let n = args.rows;
        let mut json = Map::new();
        json.insert("rows".into(), n.into());
        eprintln!("ceiling: raw publish+confirm of {n} messages at depth {DEPTH} ...");
        let ceiling = ceiling(&conn, n).await?;
        purge(&conn).await?;
        let table = vec![
            "| measure | value | ratio | target |".to_owned(),
            "|---|---|---|---|".to_owned(),
            format!(
                "| ceiling: raw publish+confirm, depth {DEPTH} | {ceiling:.0} msg/s | 1.00 | — |"
            ),
        ];
        json.insert("ceiling_msgs_per_sec".into(), ceiling.into());
        Ok(Self {
            args,
            pool,
            conn,
            n,
            ceiling,
            p1_rate: None,
            table,
            json,
        })
    }

    pub(super) fn row(&mut self, row: String) {
        self.table.push(row);
    }

    pub(super) fn key(&mut self, key: &str, value: impl Into<Value>) {
        self.json.insert(key.into(), value.into());
    }
}

/// P1: the drain rate with one and two replicas, and into a quorum queue.
pub async fn p1(s: &mut Sheet<'_>) -> BoxResult<()> {
    let (n, ceiling) = (s.n, s.ceiling);
    let mut p1 = Vec::new();
    for replicas in [1, 2] {
        eprintln!("P1: prefilling {n} rows, draining with {replicas} replica(s) ...");
        prefill(&s.pool, n).await?;
        let run = drain(&s.pool, &s.args.amqp_url, n, replicas, &[]).await?;
        let rate = run.rows_per_sec;
        purge(&s.conn).await?;
        s.row(format!(
            "| P1 drain rate, {n} rows, {replicas} replica(s), defaults | {rate:.0} rows/s | {:.2}× ceiling | ≥ 0.9× (1 replica) |",
            rate / ceiling
        ));
        if replicas == 1 {
            s.p1_rate = Some(rate);
            s.key("p1_ratio", rate / ceiling);
            s.key("p8_wal_bytes_per_event", run.wal_bytes_per_row);
            s.row(format!(
                "| P8 drainer WAL per event drained (1 replica, defaults) | {:.0} bytes | — | ≤ ½ of the first measurement |",
                run.wal_bytes_per_row
            ));
        }
        p1.push(json!({
            "replicas": replicas, "rows_per_sec": rate, "ratio_to_ceiling": rate / ceiling,
            "wal_bytes_per_row": run.wal_bytes_per_row
        }));
    }
    s.key("p1", p1);
    eprintln!("P1: the same with one replica into a quorum queue ...");
    sink(&s.conn, QueueType::Quorum).await?;
    prefill(&s.pool, n).await?;
    let quorum = drain(&s.pool, &s.args.amqp_url, n, 1, &[])
        .await?
        .rows_per_sec;
    sink(&s.conn, QueueType::Classic).await?;
    let classic = s.p1_rate.expect("measured above");
    s.row(format!(
        "| P1 drain rate into a quorum queue against a classic one ({classic:.0} rows/s), 1 replica | {quorum:.0} rows/s | {:.2}× classic | ≥ 0.7× |",
        quorum / classic
    ));
    s.key("p1_quorum_vs_classic", quorum / classic);
    Ok(())
}

/// P7: the consume ceiling and the subscriber (see [`p7`]).
pub async fn p7_section(s: &mut Sheet<'_>) -> BoxResult<()> {
    let n = s.n;
    eprintln!("P7: consume ceiling and the subscriber over {n} deliveries (4 runs) ...");
    let [ceiling7, defaults, duplicates, single, wal, on_classic] =
        p7(&s.conn, &s.pool, &s.args.amqp_url, n).await?;
    s.row(format!(
        "| P7 consume ceiling: raw lapin consume + ack, prefetch as the subscriber's | {ceiling7:.0} msg/s | 1.00 | — |"
    ));
    let vs_p1 = s.p1_rate.map(|r| defaults / r);
    s.row(format!(
        "| P7 subscriber, defaults, {n} fresh events | {defaults:.0} events/s | {:.2}× consume ceiling{} | ≥ 0.6× ceiling, ≥ 1.0× one drainer |",
        defaults / ceiling7,
        vs_p1.map_or(String::new(), |r| format!(", {r:.2}× one drainer"))
    ));
    s.row(format!(
        "| P7 subscriber, defaults, 25 % duplicates | {duplicates:.0} deliveries/s | {:.2}× defaults | ≥ 0.9× defaults |",
        duplicates / defaults
    ));
    s.row(format!(
        "| P7 subscriber, batches of one (one transaction per delivery) | {single:.0} events/s | {:.2}× defaults | contrast |",
        single / defaults
    ));
    s.row(format!(
        "| P8 inbox WAL per event applied (defaults) | {wal:.0} bytes | — | — |"
    ));
    s.row(format!(
        "| P7 subscriber, defaults, quorum queue against a classic one ({on_classic:.0} events/s) | {defaults:.0} events/s | {:.2}× classic | ≥ 0.7× |",
        defaults / on_classic
    ));
    s.key("p7_quorum_vs_classic", defaults / on_classic);
    s.key("p7_consume_ceiling_msgs_per_sec", ceiling7);
    s.key("p7_subscriber_events_per_sec", defaults);
    s.key("p7_subscriber_events_per_sec_25pct_duplicates", duplicates);
    s.key("p7_subscriber_batch_of_one_events_per_sec", single);
    s.key("p7_vs_ceiling", defaults / ceiling7);
    if let Some(r) = vs_p1 {
        s.key("p7_vs_p1", r);
    }
    s.key("p7_duplicates_vs_defaults", duplicates / defaults);
    s.key("p8_inbox_wal_bytes_per_event", wal);
    Ok(())
}

/// The ceiling beside the database work of a drain.
pub async fn beside(s: &mut Sheet<'_>) -> BoxResult<()> {
    let pace = s.p1_rate.unwrap_or(s.ceiling * 0.6);
    eprintln!("ceiling beside the database work of a drain at {pace:.0} rows/s ...");
    let beside = ceiling_beside_database(&s.conn, &s.pool, s.n, pace).await?;
    purge(&s.conn).await?;
    s.row(format!(
        "| ceiling beside claim+mark at {pace:.0} rows/s on the same cores | {beside:.0} msg/s | {:.2}× ceiling | — |",
        beside / s.ceiling
    ));
    s.key(
        "ceiling_beside_database",
        json!({ "msgs_per_sec": beside, "claim_mark_rows_per_sec": pace }),
    );
    Ok(())
}

/// P1's phases: one replica's ticks back to back.
pub async fn phases_section(s: &mut Sheet<'_>) -> BoxResult<()> {
    eprintln!(
        "P1 phases: one replica's ticks back to back over {} rows ...",
        s.n
    );
    let (rate, [claim, publish, mark]) = phases(&s.pool, &s.args.amqp_url, s.n).await?;
    purge(&s.conn).await?;
    s.row(format!(
        "| P1 phases, `Drainer::tick` back to back | {rate:.0} rows/s; per tick of 100: claim {:.2} ms, publish+confirm {:.2} ms, mark {:.2} ms | {:.2}× ceiling | — |",
        ms(claim),
        ms(publish),
        ms(mark),
        rate / s.ceiling
    ));
    s.key(
        "p1_phases",
        json!({
            "rows_per_sec": rate, "claim_ms": ms(claim), "publish_ms": ms(publish), "mark_ms": ms(mark)
        }),
    );
    Ok(())
}

/// The pre-#478 drainer, for contrast.
pub async fn antipattern_section(s: &mut Sheet<'_>) -> BoxResult<()> {
    eprintln!("antipattern: the pre-#478 drainer over {} rows ...", s.n);
    let rate = antipattern(&s.pool, &s.args.amqp_url, s.n).await?;
    purge(&s.conn).await?;
    s.row(format!(
        "| antipattern (pre-#478: one tx across the batch, confirm per row) | {rate:.0} rows/s | {:.2}× ceiling | contrast |",
        rate / s.ceiling
    ));
    s.key("antipattern_rows_per_sec", rate);
    Ok(())
}

/// P2: claim + mark at 10k rows and at `--p2-rows`.
pub async fn p2(s: &mut Sheet<'_>) -> BoxResult<()> {
    let rows = s.args.p2_rows;
    eprintln!("P2: claim + mark at 10k and {rows} rows (minutes) ...");
    let [small, large, behind] = claim_scaling(&s.pool, 10_000, rows).await?;
    s.row(format!(
        "| P2 claim+mark, 10k unpublished rows | {small:.0} rows/s | 1.00 | — |"
    ));
    s.row(format!(
        "| P2 claim+mark, {rows} unpublished rows | {large:.0} rows/s | {:.2}× 10k | ≥ 0.8× |",
        large / small
    ));
    s.row(format!(
        "| P2 claim+mark, 10k unpublished behind {rows} published | {behind:.0} rows/s | {:.2}× 10k | — |",
        behind / small
    ));
    s.key(
        "p2_rows_per_sec",
        json!({
            "small_10k": small, "large": large, "large_rows": rows, "behind_published": behind
        }),
    );
    Ok(())
}

/// P3: the database's cost per drained event.
pub async fn p3_section(s: &mut Sheet<'_>) -> BoxResult<()> {
    p3::run(&s.pool, &s.args.amqp_url, s.n, &mut s.table, &mut s.json).await?;
    purge(&s.conn).await
}

/// P4: what `publish_tx` adds to a domain transaction.
pub async fn p4(s: &mut Sheet<'_>) -> BoxResult<()> {
    eprintln!("P4: publish cost ...");
    let p4 = publish_cost(&s.pool, 500).await?;
    let base = p4[0].0;
    let names = [
        "domain tx alone",
        "domain tx + publish_tx(1)",
        "domain tx + publish_many_tx(100)",
    ];
    for (name, (p50, p99)) in names.iter().zip(p4.iter()) {
        s.row(format!(
            "| P4 {name} | p50 {:.2} ms, p99 {:.2} ms | {:.2}× alone | — |",
            ms(*p50),
            ms(*p99),
            p50.as_secs_f64() / base.as_secs_f64()
        ));
    }
    s.row(format!(
        "| P4 publish_many_tx(100) / publish_tx(1), p50 | {:.2}× | | ≤ 3× |",
        p4[2].0.as_secs_f64() / p4[1].0.as_secs_f64()
    ));
    s.key(
        "p4_ms",
        json!({
            "alone": { "p50": ms(p4[0].0), "p99": ms(p4[0].1) },
            "publish_tx_1": { "p50": ms(p4[1].0), "p99": ms(p4[1].1) },
            "publish_many_tx_100": { "p50": ms(p4[2].0), "p99": ms(p4[2].1) },
        }),
    );
    Ok(())
}

/// P9: the drainer and the subscriber under a broker outage.
pub async fn p9_section(s: &mut Sheet<'_>) -> BoxResult<()> {
    let (url, n) = (s.args.amqp_url.clone(), s.n);
    p9(&s.pool, &url, n, &mut s.table, &mut s.json).await?;
    purge(&s.conn).await?;
    p9_subscriber(&s.conn, &s.pool, &url, n, &mut s.table, &mut s.json).await
}

/// P9f: a failing handler.
pub async fn p9f(s: &mut Sheet<'_>) -> BoxResult<()> {
    let (url, n) = (s.args.amqp_url.clone(), s.n);
    p9_failing(&s.conn, &s.pool, &url, n, &mut s.table, &mut s.json).await
}

/// P5: end-to-end latency at 100 events/s.
pub async fn p5(s: &mut Sheet<'_>) -> BoxResult<()> {
    eprintln!("P5: end-to-end latency at 100 events/s for 20 s ...");
    let (p50, p99, max) = end_to_end(&s.pool, &s.args.amqp_url, 100, 20).await?;
    purge(&s.conn).await?;
    s.row(format!(
        "| P5 commit → marked published, 100 events/s | p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms | | p50 ≤ 20 ms, p99 ≤ 100 ms |",
        ms(p50),
        ms(p99),
        ms(max)
    ));
    s.key(
        "p5_ms",
        json!({ "p50": ms(p50), "p99": ms(p99), "max": ms(max) }),
    );
    Ok(())
}

/// P10: retention at scale, on each layout asked for.
pub async fn p10_section(s: &mut Sheet<'_>) -> BoxResult<()> {
    for &layout in s.args.p10_layouts() {
        let (rows_from, keys_before) = (s.table.len(), s.json.clone());
        let (url, rows) = (s.args.amqp_url.clone(), s.args.p10_rows);
        if layout == "partitioned" {
            let name = "harness_partitioned";
            let admin = &s.args.database_url;
            let p = benches::fresh_database(admin, name, 16).await?;
            outbox::migrate::partition(&p, None).await?;
            p10::partition_past_days(&p).await?;
            p10::run(&p, &url, rows, &mut s.table, &mut s.json).await?;
            p.close().await;
            benches::drop_database(admin, name)
                .await
                .map_err(|e| e.to_string())?;
        } else {
            p10::run(&s.pool, &url, rows, &mut s.table, &mut s.json).await?;
        }
        purge(&s.conn).await?;
        // Each layout's rows and keys say which layout they measured.
        for row in &mut s.table[rows_from..] {
            *row = row.replacen("| P10 ", &format!("| P10 ({layout}) "), 1);
        }
        let added: Vec<String> = s
            .json
            .keys()
            .filter(|k| k.starts_with("p10_") && !keys_before.contains_key(*k))
            .cloned()
            .collect();
        for k in added {
            let v = s.json.remove(&k).expect("listed");
            s.key(&k.replacen("p10_", &format!("p10_{layout}_"), 1), v);
        }
    }
    Ok(())
}
