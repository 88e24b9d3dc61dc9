//! Every boot assert and parse rule of `DrainerConfig::from_env` fails at boot
//! with an error naming the variable, its value and the rule.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox::config::vars;
use outbox::{ConfigError, DrainerConfig};

fn from(pairs: &[(&str, &str)]) -> Result<DrainerConfig, ConfigError> {
    let map: BTreeMap<String, String> = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    DrainerConfig::from_lookup(|name| map.get(name).cloned())
}

#[track_caller]
fn assert_invalid(pairs: &[(&str, &str)], var: &str, value: &str, rule_part: &str) {
    match from(pairs) {
        Err(ConfigError::Invalid {
            var: v,
            value: val,
            rule,
        }) => {
            assert_eq!(v, var);
            assert_eq!(val, value);
            assert!(
                rule.contains(rule_part),
                "rule {rule:?} lacks {rule_part:?}"
            );
            let msg = from(pairs).unwrap_err().to_string();
            assert!(
                msg.starts_with(&format!("{var}={value} is invalid")),
                "{msg}"
            );
        }
        other => panic!("expected {var} to be refused, got {other:?}"),
    }
}

#[test]
fn defaults_are_the_adrs() {
    let c = from(&[]).unwrap();
    assert_eq!(c.tick, Duration::from_millis(250));
    assert_eq!(c.batch_size, 100);
    assert_eq!(c.lease_ttl, Duration::from_secs(60));
    assert_eq!(c.pipeline_depth, 32);
    assert_eq!(c.confirm_timeout, Duration::from_secs(30));
    assert_eq!(c.max_attempts, 10);
    assert_eq!(c.retention, Duration::from_secs(7 * 86_400));
    assert_eq!(c.janitor_interval, Duration::from_secs(3600));
    assert_eq!(c.pending_warn, 10_000);
    assert_eq!(c.oldest_warn, Duration::from_secs(900));
    assert_eq!(c.exchange, "canopy.events");
    assert_eq!(c.max_rows_per_sec, None, "no drain-rate bound by default");
    assert_eq!(c.wakeup_linger, Duration::from_millis(10));
}

#[test]
fn every_variable_is_read() {
    let c = from(&[
        (vars::TICK_MS, "100"),
        (vars::BATCH_SIZE, "250"),
        (vars::LEASE_TTL_SECS, "120"),
        (vars::PIPELINE_DEPTH, "64"),
        (vars::CONFIRM_TIMEOUT_SECS, "20"),
        (vars::MAX_ATTEMPTS, "5"),
        (vars::RETENTION_DAYS, "3"),
        (vars::REPLICA_ID, "orders-7"),
        (vars::EXCHANGE, "orders.events"),
        (vars::PENDING_WARN, "50"),
        (vars::OLDEST_WARN_SECS, "60"),
        (vars::MAX_ROWS_PER_SEC, "2500"),
        (vars::WAKEUP_LINGER_MS, "25"),
    ])
    .unwrap();
    assert_eq!(c.tick, Duration::from_millis(100));
    assert_eq!(c.batch_size, 250);
    assert_eq!(c.lease_ttl, Duration::from_secs(120));
    assert_eq!(c.pipeline_depth, 64);
    assert_eq!(c.confirm_timeout, Duration::from_secs(20));
    assert_eq!(c.max_attempts, 5);
    assert_eq!(c.retention, Duration::from_secs(3 * 86_400));
    assert_eq!(c.replica_id, "orders-7");
    assert_eq!(c.exchange, "orders.events");
    assert_eq!(c.pending_warn, 50);
    assert_eq!(c.oldest_warn, Duration::from_secs(60));
    assert_eq!(c.max_rows_per_sec.map(|r| r.get()), Some(2500));
    assert_eq!(c.wakeup_linger, Duration::from_millis(25));
    let unbounded = from(&[(vars::MAX_ROWS_PER_SEC, "0")]).unwrap();
    assert_eq!(unbounded.max_rows_per_sec, None, "0 means no bound");
}

#[test]
fn the_replica_id_falls_back_to_hostname_pid_and_a_uuid_v7() {
    let id = from(&[]).unwrap().replica_id;
    let pid = std::process::id().to_string();
    assert!(id.starts_with("drainer-"), "{id}");
    let uuid_tail = &id[id.len() - 36..];
    let uuid: uuid::Uuid = uuid_tail.parse().expect("ends with a uuid");
    assert_eq!(uuid.get_version_num(), 7);
    assert!(id.contains(&format!("-{pid}-")), "{id} lacks the pid");
    assert_ne!(from(&[]).unwrap().replica_id, id, "unique per drainer");
}

/// Every number `DrainerConfig::from_env` reads.
const DRAINER_NUMBERS: [&str; 11] = [
    vars::TICK_MS,
    vars::BATCH_SIZE,
    vars::LEASE_TTL_SECS,
    vars::PIPELINE_DEPTH,
    vars::CONFIRM_TIMEOUT_SECS,
    vars::MAX_ATTEMPTS,
    vars::RETENTION_DAYS,
    vars::PENDING_WARN,
    vars::OLDEST_WARN_SECS,
    vars::MAX_ROWS_PER_SEC,
    vars::WAKEUP_LINGER_MS,
];

#[test]
fn non_numbers_are_refused_naming_the_variable() {
    for var in DRAINER_NUMBERS {
        assert_invalid(&[(var, "ten")], var, "ten", "whole number");
        assert_invalid(&[(var, "-1")], var, "-1", "whole number");
    }
}

#[test]
fn batch_size_must_be_positive_and_bounded() {
    assert_invalid(&[(vars::BATCH_SIZE, "0")], vars::BATCH_SIZE, "0", "> 0");
    assert_invalid(
        &[(vars::BATCH_SIZE, "10001")],
        vars::BATCH_SIZE,
        "10001",
        "<= 10000",
    );
}

#[test]
fn pipeline_depth_must_be_positive() {
    assert_invalid(
        &[(vars::PIPELINE_DEPTH, "0")],
        vars::PIPELINE_DEPTH,
        "0",
        "> 0",
    );
}

#[test]
fn the_wakeup_linger_stays_below_the_tick() {
    let none = from(&[(vars::WAKEUP_LINGER_MS, "0")]).unwrap();
    assert!(none.wakeup_linger.is_zero(), "0 claims at once");
    assert_invalid(
        &[(vars::WAKEUP_LINGER_MS, "250")],
        vars::WAKEUP_LINGER_MS,
        "250",
        "< CANOPY_MQ_DRAINER_TICK_MS",
    );
    assert_invalid(
        &[(vars::TICK_MS, "50"), (vars::WAKEUP_LINGER_MS, "60")],
        vars::WAKEUP_LINGER_MS,
        "60",
        "(50)",
    );
}

#[test]
fn tick_and_max_attempts_must_be_positive() {
    assert_invalid(&[(vars::TICK_MS, "0")], vars::TICK_MS, "0", "> 0");
    assert_invalid(&[(vars::MAX_ATTEMPTS, "0")], vars::MAX_ATTEMPTS, "0", "> 0");
}

#[test]
fn the_lease_must_cover_three_worst_case_batches() {
    // 3 x 32 x 100 ms = 9.6 s: 9 s is refused, 10 s passes (with a timeout below it).
    assert_invalid(
        &[
            (vars::LEASE_TTL_SECS, "9"),
            (vars::CONFIRM_TIMEOUT_SECS, "4"),
        ],
        vars::LEASE_TTL_SECS,
        "9",
        "9600 ms",
    );
    from(&[
        (vars::LEASE_TTL_SECS, "10"),
        (vars::CONFIRM_TIMEOUT_SECS, "4"),
    ])
    .unwrap();
    // The rule scales with the depth.
    assert_invalid(
        &[(vars::PIPELINE_DEPTH, "300")],
        vars::LEASE_TTL_SECS,
        "60",
        "90000 ms",
    );
}

#[test]
fn the_confirm_timeout_must_cover_one_worst_case_batch() {
    // 32 x 100 ms = 3.2 s.
    assert_invalid(
        &[(vars::CONFIRM_TIMEOUT_SECS, "3")],
        vars::CONFIRM_TIMEOUT_SECS,
        "3",
        "3200 ms",
    );
    from(&[(vars::CONFIRM_TIMEOUT_SECS, "4")]).unwrap();
}

#[test]
fn the_confirm_timeout_must_be_shorter_than_the_lease() {
    assert_invalid(
        &[(vars::CONFIRM_TIMEOUT_SECS, "60")],
        vars::CONFIRM_TIMEOUT_SECS,
        "60",
        "< CANOPY_MQ_DRAINER_LEASE_TTL_SECS (60)",
    );
    from(&[(vars::CONFIRM_TIMEOUT_SECS, "59")]).unwrap();
}

#[test]
fn blank_replica_ids_and_oversized_exchanges_are_refused() {
    assert_invalid(
        &[(vars::REPLICA_ID, "  ")],
        vars::REPLICA_ID,
        "  ",
        "non-blank",
    );
    let long = "x".repeat(256);
    assert_invalid(
        &[(vars::EXCHANGE, &long)],
        vars::EXCHANGE,
        &long,
        "255 bytes",
    );
}

#[test]
fn the_default_exchange_and_endless_leases_are_refused_at_boot() {
    // "" is the default exchange: it confirms every publish and routes by
    // queue name, so no topic subscription would see an event marked
    // published (issue 25).
    assert_invalid(
        &[(vars::EXCHANGE, "")],
        vars::EXCHANGE,
        "",
        "default exchange",
    );
    // A lease past PostgreSQL's timestamps failed every claim at run time.
    assert_invalid(
        &[(vars::LEASE_TTL_SECS, "300000000000")],
        vars::LEASE_TTL_SECS,
        "300000000000",
        "<= 86400",
    );
    assert!(from(&[(vars::LEASE_TTL_SECS, "86400")]).is_ok());
}

#[test]
fn the_inbox_retention_refuses_zero_days() {
    use outbox::InboxJanitorSettings;
    let e = InboxJanitorSettings::from_lookup(|v| {
        (v == vars::INBOX_RETENTION_DAYS).then(|| "0".to_owned())
    })
    .unwrap_err();
    assert!(e.to_string().contains("deduplication"), "{e}");
}

#[test]
fn a_slow_handler_is_never_cut_off_by_its_transactions_idle_bound() {
    use outbox::core::ports::TxBounds;
    // A fixed minute idle in transaction failed every attempt of a valid
    // handler given more than that (issue 25).
    for secs in [1, 30, 59, 60, 61, 600, 3600] {
        let deadline = Duration::from_secs(secs);
        let b = TxBounds::for_handler(deadline);
        assert!(b.idle >= Duration::from_secs(60));
        assert!(b.idle > deadline * 2, "{secs} s: idle {:?}", b.idle);
        assert!(b.statement > deadline && b.statement <= deadline + Duration::from_secs(1));
    }
}

#[test]
fn retention_is_bounded() {
    assert_invalid(
        &[(vars::RETENTION_DAYS, "40000")],
        vars::RETENTION_DAYS,
        "40000",
        "<= 36500",
    );
    assert_eq!(
        from(&[(vars::RETENTION_DAYS, "0")]).unwrap().retention,
        Duration::ZERO
    );
}

#[test]
fn the_deprecated_buffer_max_is_accepted_and_ignored() {
    let with = from(&[(vars::BUFFER_MAX, "1024"), (vars::REPLICA_ID, "r")]).unwrap();
    let without = from(&[(vars::REPLICA_ID, "r")]).unwrap();
    assert_eq!(with, without);
    // Even a value that was never valid does not fail boot: it is a no-op.
    from(&[(vars::BUFFER_MAX, "lots")]).unwrap();
}

#[test]
fn the_builder_applies_the_same_rules() {
    let err = DrainerConfig::builder()
        .lease_ttl_secs(5)
        .confirm_timeout_secs(4)
        .build()
        .unwrap_err();
    assert!(matches!(err, ConfigError::Invalid { var, .. } if var == vars::LEASE_TTL_SECS));
    let err = DrainerConfig::builder()
        .janitor_batch(0)
        .build()
        .unwrap_err();
    assert!(matches!(
        &err,
        ConfigError::Invalid { var, .. } if var == "janitor_batch"
    ));
    let ok = DrainerConfig::builder()
        .replica_id("svc-1")
        .pipeline_depth(8)
        .lease_ttl_secs(3)
        .confirm_timeout_secs(1)
        .build()
        .unwrap();
    assert_eq!(ok.pipeline_depth, 8);
}

#[test]
fn subscriber_variables_are_read_and_checked_naming_them() {
    let read = |pairs: &[(&str, &str)]| {
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        outbox::SubscriberSettings::from_lookup("billing.orders", &["orders.*"], |name| {
            map.get(name).cloned()
        })
    };
    let defaults = read(&[]).unwrap();
    assert_eq!(defaults.max_body_bytes, 1024 * 1024);
    assert_eq!(defaults.handler_timeout, Duration::from_secs(30));
    assert_eq!(
        (defaults.batch_max, defaults.batch_linger),
        (
            outbox::config::SUBSCRIBER_BATCH_MAX_DEFAULT,
            outbox::config::SUBSCRIBER_BATCH_LINGER_DEFAULT
        )
    );
    assert_eq!(defaults.spec.queue_type, outbox::QueueType::Quorum);
    for (value, kind) in [
        ("classic", outbox::QueueType::Classic),
        (" Quorum ", outbox::QueueType::Quorum),
    ] {
        let s = read(&[("CANOPY_MQ_SUBSCRIBER_QUEUE_TYPE", value)]).unwrap();
        assert_eq!(s.spec.queue_type, kind);
    }
    assert_eq!(
        read(&[("CANOPY_MQ_SUBSCRIBER_MAX_ATTEMPTS", "100")])
            .unwrap()
            .max_attempts,
        100
    );
    let s = read(&[
        ("CANOPY_MQ_SUBSCRIBER_MAX_BODY_BYTES", "2048"),
        ("CANOPY_MQ_SUBSCRIBER_HANDLER_TIMEOUT_SECS", "5"),
        ("CANOPY_MQ_SUBSCRIBER_BATCH_MAX", "1"),
        ("CANOPY_MQ_SUBSCRIBER_BATCH_LINGER_MS", "0"),
    ])
    .unwrap();
    assert_eq!(
        (
            s.max_body_bytes,
            s.handler_timeout,
            s.batch_max,
            s.batch_linger
        ),
        (2048, Duration::from_secs(5), 1, Duration::ZERO)
    );
    for (var, value, rule) in [
        ("CANOPY_MQ_SUBSCRIBER_MAX_BODY_BYTES", "1023", ">= 1024"),
        ("CANOPY_MQ_SUBSCRIBER_HANDLER_TIMEOUT_SECS", "0", "> 0"),
        ("CANOPY_MQ_SUBSCRIBER_BATCH_MAX", "0", "> 0"),
        ("CANOPY_MQ_SUBSCRIBER_BATCH_MAX", "65", "<= 64"),
        ("CANOPY_MQ_SUBSCRIBER_BATCH_LINGER_MS", "1001", "<= 1000"),
        ("CANOPY_MQ_SUBSCRIBER_BATCH_LINGER_MS", "-1", "whole number"),
        ("CANOPY_MQ_SUBSCRIBER_MAX_ATTEMPTS", "101", "<= 100"),
        (
            "CANOPY_MQ_SUBSCRIBER_QUEUE_TYPE",
            "mirrored",
            "quorum or classic",
        ),
        ("CANOPY_MQ_SUBSCRIBER_QUEUE_TYPE", "", "quorum or classic"),
        (
            "CANOPY_MQ_SUBSCRIBER_HANDLER_TIMEOUT_SECS",
            "3601",
            "<= 3600",
        ),
        (
            "CANOPY_MQ_SUBSCRIBER_HANDLER_TIMEOUT_SECS",
            "1.5",
            "whole number",
        ),
    ] {
        let e = read(&[(var, value)]).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("{var}={value} is invalid")) && e.contains(rule),
            "{e}"
        );
    }
}

/// Every number has a ceiling, and a number past its type's largest names
/// that ceiling, never "not a whole number".
#[test]
fn every_number_has_a_ceiling_and_the_error_names_it() {
    let past_u64 = "18446744073709551616";
    for var in DRAINER_NUMBERS {
        assert_invalid(&[(var, past_u64)], var, past_u64, "must be <= ");
        // The largest whole number any of them holds is refused by the
        // variable's own ceiling (or by a rule tying it to another).
        assert!(
            from(&[(var, "18446744073709551615")]).is_err(),
            "{var}=u64::MAX accepted"
        );
    }
    assert_invalid(
        &[(vars::BATCH_SIZE, "4294967296")],
        vars::BATCH_SIZE,
        "4294967296",
        "<= 4294967295",
    );
    assert_invalid(
        &[(vars::TICK_MS, "60001")],
        vars::TICK_MS,
        "60001",
        "<= 60000",
    );
    assert!(from(&[(vars::TICK_MS, "60000")]).is_ok());
    assert_invalid(
        &[(vars::MAX_ATTEMPTS, "10001")],
        vars::MAX_ATTEMPTS,
        "10001",
        "<= 10000",
    );
    assert_invalid(
        &[(vars::OLDEST_WARN_SECS, "31536001")],
        vars::OLDEST_WARN_SECS,
        "31536001",
        "<= 31536000",
    );
    let sub = |var: &'static str, value: &'static str| {
        outbox::SubscriberSettings::from_lookup("q", &["k"], move |v| {
            (v == var).then(|| value.to_owned())
        })
    };
    for var in [
        vars::SUBSCRIBER_PREFETCH,
        vars::SUBSCRIBER_CONCURRENCY,
        vars::SUBSCRIBER_MAX_ATTEMPTS,
        vars::SUBSCRIBER_MAX_BODY_BYTES,
        vars::SUBSCRIBER_HANDLER_TIMEOUT_SECS,
        vars::SUBSCRIBER_BATCH_MAX,
        vars::SUBSCRIBER_BATCH_LINGER_MS,
        vars::SUBSCRIBER_PARTITIONS,
    ] {
        let e = sub(var, past_u64).unwrap_err().to_string();
        assert!(e.contains("must be <= "), "{var}: {e}");
        assert!(sub(var, "4294967295").is_err(), "{var}=u32::MAX accepted");
    }
    let e = sub(vars::SUBSCRIBER_PREFETCH, "65536")
        .unwrap_err()
        .to_string();
    assert!(e.ends_with("must be <= 65535"), "{e}");
}

/// Names that reach logs, `claimed_by` or the broker refuse control
/// characters.
#[test]
fn identifiers_refuse_control_characters() {
    for id in [
        "drainer-1\nforged line",
        "a\u{1b}[31mred",
        "tab\there",
        "nul\0",
    ] {
        let e = from(&[(vars::REPLICA_ID, id)]).unwrap_err();
        let ConfigError::Invalid { var, value, rule } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(*var, vars::REPLICA_ID);
        assert!(rule.contains("control character"), "{rule}");
        // The error itself shows the value escaped: one line, no escape
        // sequence reaches a terminal.
        assert!(!value.contains(|c: char| c.is_control()), "{value:?}");
        assert!(!e.to_string().contains(|c: char| c.is_control()), "{e}");
        let e = from(&[(vars::EXCHANGE, id)]).unwrap_err();
        assert!(e.to_string().contains("control character"), "{e}");
        let e = outbox::SubscriberSettings::from_lookup("q", &["k"], |v| {
            (v == vars::EXCHANGE).then(|| id.to_owned())
        })
        .unwrap_err();
        assert!(e.to_string().contains("control character"), "{e}");
        let e = outbox::SubscriberSettings::new(id, &["k"])
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("control character"), "{e}");
    }
    assert!(from(&[(vars::REPLICA_ID, "drainer-é-1")]).is_ok());
}

/// A node list is separated by commas and nothing else.
#[test]
fn a_node_list_takes_commas_only() {
    assert!(outbox::LapinBroker::from_list("amqp://a:5672/%2f , amqp://b:5672/%2f").is_ok());
    for list in [
        "amqp://a:5672/%2f;amqp://b:5672/%2f",
        "amqp://a:5672/%2f amqp://b:5672/%2f",
        "amqp://a:5672/%2f|amqp://b:5672/%2f",
        "amqp://a:5672/%2f\tamqp://b:5672/%2f",
    ] {
        let e = outbox::LapinBroker::from_list(list)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("separate addresses with commas only"),
            "{list}: {e}"
        );
    }
}

/// The AMQP heartbeat is whole seconds from 1 to 300: there is no "off".
#[test]
fn the_amqp_heartbeat_is_bounded_and_never_off() {
    let b = || outbox::LapinBroker::new("amqp://localhost");
    assert!(b().with_heartbeat(Duration::from_secs(1)).is_ok());
    assert!(b().with_heartbeat(Duration::from_secs(300)).is_ok());
    for bad in [
        Duration::ZERO,
        Duration::from_secs(301),
        Duration::from_millis(1500),
    ] {
        let e = b().with_heartbeat(bad).unwrap_err().to_string();
        assert!(
            e.starts_with("CANOPY_MQ_AMQP_HEARTBEAT_SECS=") && e.contains("<= 300"),
            "{bad:?}: {e}"
        );
    }
}

#[test]
fn durable_standbys_are_a_list_of_application_names() {
    let v = vars::DURABLE_STANDBYS;
    assert!(
        from(&[]).unwrap().durable_standbys.is_empty(),
        "none by default"
    );
    assert_eq!(
        from(&[(v, " pg2 , eu-west-b ,")]).unwrap().durable_standbys,
        ["pg2", "eu-west-b"],
        "spaces around names and empty items are ignored"
    );
    assert_invalid(&[(v, "pg2,pg2")], v, "pg2,pg2", "names pg2 twice");
    let long = "s".repeat(64);
    assert_invalid(&[(v, &long)], v, &long, "1 to 63 bytes");
    assert_invalid(&[(v, "pg2,sé")], v, "pg2,sé", "printable ASCII");
    let any = from(&[(v, "any 1 (pg1, pg2)")]).unwrap();
    assert_eq!(any.durable_standbys, ["pg1", "pg2"]);
    assert_eq!(any.durable_standbys_any, Some(1));
    assert_eq!(from(&[(v, "pg2")]).unwrap().durable_standbys_any, None);
    assert_invalid(&[(v, "ANY 3 (pg1, pg2)")], v, "ANY 3 (pg1, pg2)", "1 <= n");
    assert_invalid(&[(v, "ANY x (pg1)")], v, "ANY x (pg1)", "ANY n (a, b)");
    assert_invalid(&[(v, "ANY 1 pg1")], v, "ANY 1 pg1", "ANY n (a, b)");
    // Built in code: the same rules.
    let e = DrainerConfig::builder()
        .durable_standbys(["a\tb"])
        .build()
        .unwrap_err();
    assert!(
        e.to_string().starts_with("CANOPY_MQ_DURABLE_STANDBYS="),
        "{e}"
    );
}
