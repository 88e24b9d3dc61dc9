//! The properties of the simulation's parsers: the scenario loader, and
//! the fake PostgreSQL's `jsonb` held to the real one. The targets call
//! them under libFuzzer; `sim/tests/fuzz_regressions.rs` on stable over the
//! committed inputs. A property fails by panicking.

/// Any scenario file: a clear error, or a scenario the world can be built
/// for (its engine settings and its faults for a few seeds drawn without a
/// panic, its time bounded).
pub fn scenario(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(scenario) = sim::scenario::Scenario::parse("fuzz.toml", "fuzz".into(), text) else {
        return;
    };
    for seed in [0, 1, u64::MAX] {
        let settings = sim::world::settings(&scenario, seed);
        assert!(settings.limit < std::time::Duration::from_secs(86_400 * 365));
        let _ = sim::world::faults_of(&scenario, seed);
    }
}

/// The same JSON value, numbers compared as numbers: `jsonb` keeps a
/// number as `numeric` and writes it its own way (`-0` as `0`, `1e2` as
/// `100`), which the fake, storing the text as given, does not.
fn same_value(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value;
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x == y || x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_value(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_value(v, w)))
        }
        _ => a == b,
    }
}

/// What PostgreSQL made of a text as `jsonb`: its `jsonb::text`, or the
/// SQLSTATE it refused it with.
pub type PgVerdict = Result<String, String>;

/// Any text as `jsonb`, through the fake PostgreSQL and through the real
/// one (`ask`): they agree on accepting it, on the SQLSTATE of a refusal,
/// and on the value stored.
pub fn jsonb(data: &[u8], ask: impl FnOnce(&str) -> PgVerdict) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let fake = sim::fakes::pg::jsonb::jsonb_refusal(text);
    let real = ask(text);
    match (&fake, &real) {
        (None, Ok(stored)) => {
            let ours = serde_json::from_str::<serde_json::Value>(text);
            let theirs = serde_json::from_str::<serde_json::Value>(stored);
            if let (Ok(ours), Ok(theirs)) = (ours, theirs) {
                assert!(
                    same_value(&ours, &theirs),
                    "{text:?} is stored as {stored:?}"
                );
            }
        }
        (Some(refusal), Err(code)) => assert_eq!(
            refusal.code, code,
            "{text:?}: the fake refuses with {}, PostgreSQL with {code}",
            refusal.code
        ),
        _ => panic!("{text:?}: the fake says {fake:?}, PostgreSQL {real:?}"),
    }
}

/// Asks PostgreSQL on `conn` what it makes of `text` as `jsonb`, for
/// [`jsonb`]'s `ask` (the fuzz target and the stable replay alike).
pub fn ask_postgres(
    rt: &tokio::runtime::Runtime,
    conn: &mut sqlx::PgConnection,
    text: &str,
) -> PgVerdict {
    rt.block_on(
        sqlx::query_scalar::<_, String>("SELECT $1::jsonb::text")
            .bind(text)
            .fetch_one(conn),
    )
    .map_err(|e| {
        e.as_database_error()
            .and_then(|d| d.code())
            .map(|c| c.into_owned())
            .unwrap_or_else(|| panic!("PostgreSQL did not answer: {e}"))
    })
}
