//! The operator console (issue 29) on a real database: sign-in and the
//! session cookie, CSRF on every action, escaping of hostile rows,
//! read-only mode, and the actions' effects (HTTP level); then the same in
//! a real browser, Debian's Chromium driven headless through chromedriver
//! (`.ci/run` installs both), in `a_browser_finds_and_fixes_…`.

#[path = "../../outbox/tests/common/mod.rs"]
mod common;
mod webdriver;

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use outbox::{
    EventEnvelope, HandlerError, LapinBroker, PgInboxStore, PgOutboxStore, PgTx, Publisher,
    Subscriber, SubscriberSettings, TokioClock,
};
use outbox_admin::{AdminAuth, AdminRouter, ConsoleSettings};
use sqlx::PgPool;
use tower::ServiceExt;
use uuid::Uuid;

const TOKEN: &str = "a-long-enough-admin-token";
const SUBSCRIPTION: &str = "console.test.shipments";
const HOSTILE: &str = r#"<script>alert("x")</script>' onmouseover="alert(1)"#;

/// Applies an event by recording it; refuses events whose payload says so.
struct Effects;

impl outbox::Handler<PgTx> for Effects {
    async fn handle(&self, tx: &mut PgTx, event: &EventEnvelope) -> Result<(), HandlerError> {
        if event.payload["refuse"] == true {
            return Err(HandlerError::msg("still refused"));
        }
        sqlx::query("INSERT INTO effects (event_id) VALUES ($1)")
            .bind(event.id)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// The admin router with the console, an outbox and a (not consuming)
/// subscriber whose replay runs `Effects`.
async fn router(pool: &PgPool, settings: ConsoleSettings) -> axum::Router {
    sqlx::query("CREATE TABLE IF NOT EXISTS effects (event_id UUID PRIMARY KEY)")
        .execute(pool)
        .await
        .unwrap();
    let subscriber = Subscriber::new(
        Arc::new(PgInboxStore::new(pool.clone())),
        Arc::new(LapinBroker::new(common::amqp_url())),
        Arc::new(TokioClock::default()),
        Arc::new(Effects),
        SubscriberSettings::new(SUBSCRIPTION, &["orders.#"]),
    );
    AdminRouter::new(AdminAuth::bearer(TOKEN).unwrap())
        .outbox(PgOutboxStore::new(pool.clone()))
        .subscriber(Arc::new(subscriber))
        .console(settings)
        .build()
}

/// Two parked outbox rows (one with a hostile error) and three
/// dead-lettered inbox rows (one hostile, one the handler still refuses);
/// returns the parked ids and the dead-lettered ids.
async fn seed(pool: &PgPool) -> (Vec<Uuid>, Vec<Uuid>) {
    let publisher = Publisher::new(pool.clone());
    let mut parked = Vec::new();
    for (key, error, note) in [
        ("orders.created", "broker nack", "plain"),
        ("billing.charged", HOSTILE, HOSTILE),
    ] {
        let e = EventEnvelope::new(key, serde_json::json!({ "n": 1, "note": note }))
            .with_header("tenant", note);
        publisher.publish(&e).await.unwrap();
        sqlx::query("UPDATE event_outbox SET parked_at = now(), attempts = 10, last_error = $2 WHERE id = $1")
            .bind(e.id)
            .bind(error)
            .execute(pool)
            .await
            .unwrap();
        parked.push(e.id);
    }
    let mut dead = Vec::new();
    for payload in [
        serde_json::json!({ "customer": { "id": "c-1" } }),
        serde_json::json!({ "customer": { "id": "c-2" }, "note": HOSTILE }),
        serde_json::json!({ "customer": { "id": "c-2" }, "refuse": true }),
    ] {
        let e = EventEnvelope::new("orders.created", payload).with_header("tenant", HOSTILE);
        sqlx::query(
            "INSERT INTO event_inbox (event_id, subscription, routing_key, payload, attempts, last_error, dead_lettered_at)
             VALUES ($1, $2, $3, $4::jsonb, 3, $5, now())",
        )
        .bind(e.id)
        .bind(SUBSCRIPTION)
        .bind(&e.routing_key)
        .bind(serde_json::to_string(&e).unwrap())
        .bind(format!("handler failed: {HOSTILE}"))
        .execute(pool)
        .await
        .unwrap();
        dead.push(e.id);
    }
    (parked, dead)
}

struct Answer {
    status: StatusCode,
    location: Option<String>,
    cookies: Vec<String>,
    body: String,
}

async fn send(
    r: &axum::Router,
    method: &str,
    uri: &str,
    cookie: Option<&str>,
    form: Option<&str>,
) -> Answer {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(c) = cookie {
        req = req.header(header::COOKIE, c);
    }
    if form.is_some() {
        req = req.header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
    }
    let resp = r
        .clone()
        .oneshot(req.body(Body::from(form.unwrap_or("").to_owned())).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let location = resp
        .headers()
        .get(header::LOCATION)
        .map(|v| v.to_str().unwrap().to_owned());
    let cookies = resp
        .headers()
        .get_all(header::SET_COOKIE)
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 22)
        .await
        .unwrap();
    Answer {
        status,
        location,
        cookies,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// A form posted to `route` in `session`.
async fn post(r: &axum::Router, session: &str, route: &str, form: &str) -> Answer {
    send(r, "POST", route, Some(session), Some(form)).await
}

/// What `sql` (a `SELECT count(*)`) counts.
async fn count(pool: &PgPool, sql: &str) -> i64 {
    let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap();
    n
}

/// `name=value` of the first `Set-Cookie` naming `name`.
fn cookie_pair(a: &Answer, name: &str) -> String {
    let c = a
        .cookies
        .iter()
        .find(|c| c.starts_with(&format!("{name}=")))
        .expect(name);
    c.split(';').next().unwrap().to_owned()
}

/// The value of the hidden field `name` in a page.
fn field(body: &str, name: &str) -> String {
    let at = body
        .find(&format!("name=\"{name}\" value=\""))
        .unwrap_or_else(|| panic!("no {name} in {body}"));
    let rest = &body[at + name.len() + 15..];
    rest[..rest.find('"').unwrap()].to_owned()
}

/// Signs in; returns the session cookie and the session's CSRF token.
async fn sign_in(r: &axum::Router) -> (String, String) {
    let form = send(r, "GET", "/admin/login", None, None).await;
    let login_cookie = cookie_pair(&form, "outbox_console_login");
    let nonce = field(&form.body, "login_csrf");
    let body = format!("login_csrf={nonce}&token={TOKEN}");
    let a = send(r, "POST", "/admin/login", Some(&login_cookie), Some(&body)).await;
    assert_eq!(
        (a.status, a.location.as_deref()),
        (StatusCode::SEE_OTHER, Some("/admin"))
    );
    let session = cookie_pair(&a, "outbox_console");
    let overview = send(r, "GET", "/admin", Some(&session), None).await;
    assert_eq!(overview.status, StatusCode::OK);
    (session.clone(), field(&overview.body, "csrf"))
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn signing_in_needs_the_token_and_gives_an_http_only_strict_cookie(pool: PgPool) {
    let r = router(&pool, ConsoleSettings::default()).await;
    for page in [
        "/admin",
        "/admin/parked",
        "/admin/dead",
        "/admin/parked/00000000-0000-0000-0000-000000000000",
    ] {
        let a = send(&r, "GET", page, None, None).await;
        assert_eq!(
            (a.status, a.location.as_deref()),
            (StatusCode::SEE_OTHER, Some("/admin/login")),
            "{page}"
        );
        let forged = send(&r, "GET", page, Some("outbox_console=guessed"), None).await;
        assert_eq!(forged.status, StatusCode::SEE_OTHER, "{page}");
    }
    let form = send(&r, "GET", "/admin/login", None, None).await;
    let login_cookie = cookie_pair(&form, "outbox_console_login");
    let nonce = field(&form.body, "login_csrf");
    let wrong = send(
        &r,
        "POST",
        "/admin/login",
        Some(&login_cookie),
        Some(&format!("login_csrf={nonce}&token=not-the-admin-token")),
    )
    .await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert!(
        !wrong
            .cookies
            .iter()
            .any(|c| c.starts_with("outbox_console="))
    );
    let forged = send(
        &r,
        "POST",
        "/admin/login",
        None,
        Some(&format!("login_csrf={nonce}&token={TOKEN}")),
    )
    .await;
    assert_eq!(
        forged.status,
        StatusCode::FORBIDDEN,
        "a sign-in without the form's cookie"
    );
    let ok = send(
        &r,
        "POST",
        "/admin/login",
        Some(&login_cookie),
        Some(&format!("login_csrf={nonce}&token={TOKEN}")),
    )
    .await;
    assert_eq!(ok.status, StatusCode::SEE_OTHER);
    let set = ok
        .cookies
        .iter()
        .find(|c| c.starts_with("outbox_console="))
        .unwrap();
    for attribute in ["HttpOnly", "SameSite=Strict", "Secure", "Path=/admin"] {
        assert!(set.contains(attribute), "{set}");
    }
    assert!(!set.contains(TOKEN) && !ok.location.as_deref().unwrap().contains(TOKEN));
    let session = cookie_pair(&ok, "outbox_console");
    let overview = send(&r, "GET", "/admin", Some(&session), None).await;
    assert!(!overview.body.contains(TOKEN));
    assert!(overview.body.contains("<h2>Outbox</h2>") && overview.body.contains(SUBSCRIPTION));
    let csrf = field(&overview.body, "csrf");
    let out = post(&r, &session, "/admin/logout", &format!("csrf={csrf}")).await;
    assert_eq!(out.status, StatusCode::SEE_OTHER);
    let after = send(&r, "GET", "/admin", Some(&session), None).await;
    assert_eq!(after.status, StatusCode::SEE_OTHER, "the session ended");
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn every_action_needs_the_sessions_csrf_token(pool: PgPool) {
    let r = router(&pool, ConsoleSettings::default()).await;
    let (parked, dead) = seed(&pool).await;
    let (session, csrf) = sign_in(&r).await;
    let (_, other_csrf) = sign_in(&r).await;
    let actions = [
        format!("kind=parked&op=unpark:selected&id={}", parked[0]),
        format!("kind=parked&action=unpark&id={}", parked[0]),
        format!("kind=dead&action=replay&id={SUBSCRIPTION}/{}", dead[0]),
        "kind=parked&op=skip:all".to_owned(),
    ];
    for form in &actions {
        for route in ["/admin/confirm", "/admin/run"] {
            for token in [
                String::new(),
                format!("&csrf={other_csrf}"),
                "&csrf=".into(),
            ] {
                let a = send(
                    &r,
                    "POST",
                    route,
                    Some(&session),
                    Some(&format!("{form}{token}")),
                )
                .await;
                assert_eq!(a.status, StatusCode::FORBIDDEN, "{route} {form}{token}");
            }
            let anonymous = send(
                &r,
                "POST",
                route,
                None,
                Some(&format!("{form}&csrf={csrf}")),
            )
            .await;
            assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED, "{route} {form}");
        }
    }
    let logout = send(&r, "POST", "/admin/logout", Some(&session), Some("")).await;
    assert_eq!(logout.status, StatusCode::FORBIDDEN);
    let still_parked = count(
        &pool,
        "SELECT count(*) FROM event_outbox WHERE parked_at IS NOT NULL",
    )
    .await;
    let still_dead = count(
        &pool,
        "SELECT count(*) FROM event_inbox WHERE processed_at IS NULL",
    )
    .await;
    assert_eq!(
        (still_parked, still_dead),
        (2, 3),
        "no refused form changed a row"
    );
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn hostile_rows_render_as_text(pool: PgPool) {
    let r = router(&pool, ConsoleSettings::default()).await;
    let (parked, dead) = seed(&pool).await;
    let (session, _) = sign_in(&r).await;
    let pages = [
        "/admin/parked".to_owned(),
        format!("/admin/parked/{}", parked[1]),
        "/admin/dead".to_owned(),
        format!("/admin/dead/{SUBSCRIPTION}/{}", dead[1]),
        format!("/admin/dead?error={}", "%3Cscript%3E"),
        format!("/admin/dead?path=note&value={}", "%3Cscript%3E%22"),
        format!("/admin/parked?path=note&value={}", "%3Cscript%3E%22"),
    ];
    for page in &pages {
        let a = send(&r, "GET", page, Some(&session), None).await;
        assert_eq!(a.status, StatusCode::OK, "{page}: {}", a.body);
        assert!(
            !a.body.contains("<script"),
            "{page} carries a live script tag"
        );
        assert!(
            !a.body.contains("onmouseover=\""),
            "{page} carries a live attribute"
        );
        assert!(a.body.contains("&lt;script&gt;"), "{page} shows the text");
    }
    // A parked row in full: its envelope and headers, as text.
    let a = send(
        &r,
        "GET",
        &format!("/admin/parked/{}", parked[1]),
        Some(&session),
        None,
    )
    .await;
    assert!(
        a.body.contains("tenant: &lt;script&gt;") && a.body.contains("&quot;note&quot;"),
        "{}",
        a.body
    );
    // A parked row's payload field filters the list.
    let a = send(
        &r,
        "GET",
        "/admin/parked?path=note&value=plain",
        Some(&session),
        None,
    )
    .await;
    assert!(
        a.body.contains("1 matching") && a.body.contains("orders.created"),
        "{}",
        a.body
    );
    assert!(!a.body.contains("billing.charged"), "{}", a.body);
    let a = send(&r, "GET", "/admin/parked", Some(&session), None).await;
    let csp = "default-src 'none'";
    assert!(a.body.contains("orders.created") && a.body.contains("billing.charged"));
    let full = r
        .clone()
        .oneshot(
            Request::get("/admin/parked")
                .header(header::COOKIE, &session)
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert!(
        full.headers()[header::CONTENT_SECURITY_POLICY]
            .to_str()
            .unwrap()
            .starts_with(csp)
    );
    let bad = send(
        &r,
        "GET",
        "/admin/dead?from=yesterday",
        Some(&session),
        None,
    )
    .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert!(bad.body.contains("from must be an RFC 3339 time"));
}

/// The overview's row of the subscription: processed in the last hour,
/// retrying, dead-lettered (the cells' text, links taken off).
async fn subscription_counts(r: &axum::Router, session: &str) -> [String; 3] {
    let overview = send(r, "GET", "/admin", Some(session), None).await;
    let row = overview
        .body
        .split("<tr>")
        .find(|row| row.starts_with(&format!("<td>{SUBSCRIPTION}</td>")))
        .unwrap_or_else(|| panic!("no row of {SUBSCRIPTION}: {}", overview.body));
    let cells: Vec<String> = row
        .split("<td>")
        .skip(2)
        .map(|cell| {
            let cell = cell.split("</td>").next().unwrap_or("");
            // The text of a cell that is a link.
            cell.rsplit_once("\">")
                .map_or(cell, |(_, text)| text.trim_end_matches("</a>"))
                .to_owned()
        })
        .collect();
    [cells[0].clone(), cells[1].clone(), cells[2].clone()]
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn actions_confirm_their_count_and_say_what_each_row_became(pool: PgPool) {
    let r = router(&pool, ConsoleSettings::default()).await;
    let (parked, dead) = seed(&pool).await;
    let (session, csrf) = sign_in(&r).await;
    assert_eq!(subscription_counts(&r, &session).await, ["0", "0", "3"]);
    // Everything matching a filter: one parked row of two.
    let confirm = post(
        &r,
        &session,
        "/admin/confirm",
        &format!("csrf={csrf}&kind=parked&op=unpark:all&routing_key=orders.*"),
    )
    .await;
    assert_eq!(confirm.status, StatusCode::OK, "{}", confirm.body);
    assert!(
        confirm.body.contains("Unpark 1 parked row(s)"),
        "{}",
        confirm.body
    );
    let run = post(
        &r,
        &session,
        "/admin/run",
        &format!("csrf={csrf}&kind=parked&action=unpark&id={}", parked[0]),
    )
    .await;
    assert!(
        run.body.contains("batch 1 of 1: 1 of 1 row(s) changed")
            && run.body.contains("unparked: queued for publishing"),
        "{}",
        run.body
    );
    let (attempts, is_parked): (i32, bool) =
        sqlx::query_as("SELECT attempts, parked_at IS NOT NULL FROM event_outbox WHERE id = $1")
            .bind(parked[0])
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((attempts, is_parked), (0, false));
    // A selection of dead-lettered events: one applies, one fails again.
    let ids = format!(
        "id={SUBSCRIPTION}/{}&id={SUBSCRIPTION}/{}",
        dead[0], dead[2]
    );
    let confirm = post(
        &r,
        &session,
        "/admin/confirm",
        &format!("csrf={csrf}&kind=dead&op=replay:selected&{ids}"),
    )
    .await;
    assert!(
        confirm.body.contains("Replay 2 dead-lettered event(s)"),
        "{}",
        confirm.body
    );
    let run = post(
        &r,
        &session,
        "/admin/run",
        &format!("csrf={csrf}&kind=dead&action=replay&{ids}"),
    )
    .await;
    assert!(
        run.body.contains("applied") && run.body.contains("failed again: still refused"),
        "{}",
        run.body
    );
    // The overview counts from the database: one processed, two still
    // dead-lettered.
    assert_eq!(subscription_counts(&r, &session).await, ["1", "0", "2"]);
    // Everything matching a payload field: the two events of customer c-2.
    let confirm = post(
        &r,
        &session,
        "/admin/confirm",
        &format!("csrf={csrf}&kind=dead&op=skip:all&path=customer.id&value=c-2"),
    )
    .await;
    assert!(
        confirm.body.contains("Skip 2 dead-lettered event(s)"),
        "{}",
        confirm.body
    );
    let applied = count(&pool, "SELECT count(*) FROM effects").await;
    assert_eq!(applied, 1);
    let none = post(
        &r,
        &session,
        "/admin/confirm",
        &format!("csrf={csrf}&kind=parked&op=unpark:selected"),
    )
    .await;
    assert_eq!(none.status, StatusCode::BAD_REQUEST);
    let too_many: String = (0..10_001)
        .map(|_| format!("&id={}", Uuid::now_v7()))
        .collect();
    let big = post(
        &r,
        &session,
        "/admin/confirm",
        &format!("csrf={csrf}&kind=parked&op=unpark:selected{too_many}"),
    )
    .await;
    assert_eq!(big.status, StatusCode::BAD_REQUEST, "{}", big.body);
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn an_actions_page_shows_each_batch_as_it_is_done(pool: PgPool) {
    let r = router(&pool, ConsoleSettings::default()).await;
    let publisher = Publisher::new(pool.clone());
    let mut ids = Vec::new();
    for n in 0..150 {
        let e = EventEnvelope::new("orders.created", serde_json::json!({ "n": n }));
        publisher.publish(&e).await.unwrap();
        ids.push(e.id);
    }
    sqlx::query("UPDATE event_outbox SET parked_at = now(), attempts = 10")
        .execute(&pool)
        .await
        .unwrap();
    let (session, csrf) = sign_in(&r).await;
    let form = ids.iter().fold(
        format!("csrf={csrf}&kind=parked&action=unpark"),
        |form, id| format!("{form}&id={id}"),
    );
    let resp = r
        .clone()
        .oneshot(
            Request::post("/admin/run")
                .header(header::COOKIE, &session)
                .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
                .body(Body::from(form))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    // The page arrives in pieces: the frame, then a line per batch as the
    // batch is done, then what each row became.
    let mut chunks = Vec::new();
    let mut stream = resp.into_body().into_data_stream();
    while let Some(chunk) = futures_lite::StreamExt::next(&mut stream).await {
        chunks.push(String::from_utf8(chunk.unwrap().to_vec()).unwrap());
    }
    let at = |needle: &str| {
        chunks
            .iter()
            .position(|c| c.contains(needle))
            .unwrap_or_else(|| panic!("{needle:?} not in {chunks:?}"))
    };
    let (first, second, report) = (
        at("batch 1 of 2: 100 of 100 row(s) changed"),
        at("batch 2 of 2: 50 of 50 row(s) changed"),
        at("<table>"),
    );
    assert!(
        at("<h1>") < first && first < second && second < report,
        "{chunks:?}"
    );
    let parked = count(
        &pool,
        "SELECT count(*) FROM event_outbox WHERE parked_at IS NOT NULL",
    )
    .await;
    assert_eq!(parked, 0);
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn the_lists_read_past_their_first_thousand_rows(pool: PgPool) {
    let r = router(&pool, ConsoleSettings::default()).await;
    // 1 200 dead-lettered rows, oldest first; the last 100 the only
    // `late.*` ones: past the first page of 1 000 the list reads.
    sqlx::query(
        "INSERT INTO event_inbox (event_id, subscription, routing_key, payload, attempts, last_error, dead_lettered_at, received_at)
         SELECT gen_random_uuid(), $1, CASE WHEN n > 1100 THEN 'late.x' ELSE 'early.x' END,
                '{}'::jsonb, 3, 'failed', now(), now() - make_interval(secs => 2000 - n)
         FROM generate_series(1, 1200) AS n",
    )
    .bind(SUBSCRIPTION)
    .execute(&pool)
    .await
    .unwrap();
    let (session, csrf) = sign_in(&r).await;
    let list = send(
        &r,
        "GET",
        "/admin/dead?routing_key=late.*",
        Some(&session),
        None,
    )
    .await;
    assert!(list.body.contains("100 matching"), "{}", list.body);
    let all = send(&r, "GET", "/admin/dead", Some(&session), None).await;
    assert!(all.body.contains("1200 matching"), "{}", all.body);
    let confirm = post(
        &r,
        &session,
        "/admin/confirm",
        &format!("csrf={csrf}&kind=dead&op=skip:all&routing_key=late.*"),
    )
    .await;
    assert!(
        confirm.body.contains("100 dead-lettered event(s)"),
        "{}",
        confirm.body
    );
    // And the parked list, by its own cursor.
    sqlx::query(
        "INSERT INTO event_outbox (id, routing_key, payload, attempts, last_error, parked_at)
         SELECT gen_random_uuid(), CASE WHEN n > 1100 THEN 'late.x' ELSE 'early.x' END,
                '{}'::jsonb, 10, 'nack', now() - make_interval(secs => 2000 - n)
         FROM generate_series(1, 1200) AS n",
    )
    .execute(&pool)
    .await
    .unwrap();
    let list = send(
        &r,
        "GET",
        "/admin/parked?routing_key=late.*",
        Some(&session),
        None,
    )
    .await;
    assert!(list.body.contains("100 matching"), "{}", list.body);
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_read_only_console_shows_rows_and_takes_no_action(pool: PgPool) {
    let r = router(&pool, ConsoleSettings::default().read_only(true)).await;
    let (parked, _) = seed(&pool).await;
    let (session, csrf) = sign_in(&r).await;
    let list = send(&r, "GET", "/admin/parked", Some(&session), None).await;
    assert!(
        list.body.contains("Read-only console") && !list.body.contains("action=/admin/confirm")
    );
    for route in ["/admin/confirm", "/admin/run"] {
        let a = send(
            &r,
            "POST",
            route,
            Some(&session),
            Some(&format!(
                "csrf={csrf}&kind=parked&action=unpark&op=unpark:selected&id={}",
                parked[0]
            )),
        )
        .await;
        assert_eq!(a.status, StatusCode::FORBIDDEN, "{route}");
    }
}

/// Waits for the page's main text to contain `needle` (a click's
/// navigation may still be under way); fails with the text otherwise.
async fn see(b: &webdriver::Browser, needle: &str) -> String {
    let text = b.text_with("main", needle).await;
    assert!(text.contains(needle), "{needle:?} not on the page:\n{text}");
    text
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_browser_finds_and_fixes_dead_letters_and_parked_rows(pool: PgPool) {
    let r = router(&pool, ConsoleSettings::default()).await;
    let (_, dead) = seed(&pool).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://localhost:{}", listener.local_addr().unwrap().port());
    let server = tokio::spawn(async move { axum::serve(listener, r).await });
    let b = webdriver::Browser::start().await;
    b.go(&format!("{base}/admin")).await;
    assert!(b.title().await.starts_with("Sign in"), "sent to sign in");
    b.type_into("input[name=token]", TOKEN).await;
    b.click("form[action='/admin/login'] button").await;
    see(&b, "Subscriptions").await;
    let script_sees = b.cookies_visible_to_script().await;
    assert!(
        !script_sees.contains("outbox_console="),
        "the session cookie is HttpOnly: {script_sees}"
    );
    // Dead letters: filter by a payload field; the hostile note is text.
    b.go(&format!("{base}/admin/dead?path=customer.id&value=c-2"))
        .await;
    see(&b, "2 matching").await;
    assert_eq!(
        b.count("script").await,
        0,
        "no script element came from a payload"
    );
    // Replay a selection: the first event, from the unfiltered list.
    b.go(&format!("{base}/admin/dead")).await;
    see(&b, "3 matching").await;
    // The README's picture of the console (target/console.png).
    let shot = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/console.png");
    b.screenshot(&shot).await;
    assert!(
        std::fs::read(&shot).unwrap().starts_with(b"\x89PNG"),
        "a PNG"
    );
    b.click(&format!("input[value='{SUBSCRIPTION}/{}']", dead[0]))
        .await;
    b.click("button[value='replay:selected']").await;
    see(&b, "Replay 1 dead-lettered event(s)").await;
    b.click("#confirm").await;
    see(&b, "applied").await;
    // Replay everything matching: customer c-2's two; one applies.
    b.go(&format!("{base}/admin/dead?path=customer.id&value=c-2"))
        .await;
    see(&b, "2 matching").await;
    b.click("button[value='replay:all']").await;
    see(&b, "Replay 2 dead-lettered event(s)").await;
    b.click("#confirm").await;
    let done = see(&b, "failed again: still refused").await;
    assert!(done.contains("applied"), "{done}");
    b.go(&format!("{base}/admin/dead")).await;
    see(&b, "1 matching").await;
    // Parked rows: unpark everything matching a routing key.
    b.go(&format!("{base}/admin/parked")).await;
    see(&b, "2 matching").await;
    b.go(&format!("{base}/admin/parked?routing_key=billing.*"))
        .await;
    see(&b, "1 matching").await;
    b.click("button[value='unpark:all']").await;
    see(&b, "Unpark 1 parked row(s)").await;
    b.click("#confirm").await;
    see(&b, "unparked: queued for publishing").await;
    b.go(&format!("{base}/admin/parked")).await;
    see(&b, "1 matching").await;
    b.quit().await;
    server.abort();
    let applied = count(&pool, "SELECT count(*) FROM effects").await;
    let parked = count(
        &pool,
        "SELECT count(*) FROM event_outbox WHERE parked_at IS NOT NULL",
    )
    .await;
    assert_eq!(
        (applied, parked),
        (2, 1),
        "the counts changed as the pages said"
    );
}
