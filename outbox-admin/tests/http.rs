//! The admin HTTP surface: authentication, JSON errors for bad input (never
//! a 500), parked-row listing and unpark on a real database, readiness and
//! metrics. Replay through the route is in `subscribe.rs`, next to a real
//! subscriber.

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use outbox::core::stats::{Readiness, UnreadyReason};
use outbox::{EventEnvelope, PgOutboxStore, Publisher};
use outbox_admin::{AdminAuth, AdminRouter};
use sqlx::PgPool;
use tower::ServiceExt;

const TOKEN: &str = "a-long-enough-admin-token";

async fn call(
    router: &axum::Router,
    method: &str,
    uri: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (StatusCode, serde_json::Value, String) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    if body.is_some() {
        req = req.header(header::CONTENT_TYPE, "application/json");
    }
    let req = req.body(Body::from(body.unwrap_or("").to_owned())).unwrap();
    let resp = router.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let json = serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
    (status, json, text)
}

fn router(pool: &PgPool) -> axum::Router {
    AdminRouter::new(AdminAuth::bearer(TOKEN).unwrap())
        .outbox(PgOutboxStore::new(pool.clone()))
        .build()
}

#[test]
fn the_surface_refuses_to_start_open_unless_told() {
    let e = AdminAuth::from_lookup(|_| None).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("CANOPY_MQ_ADMIN_TOKEN= is invalid: must be set"),
        "{e}"
    );
    let e = AdminAuth::from_lookup(|v| (v == "CANOPY_MQ_ADMIN_OPEN").then(|| "yes".into()))
        .unwrap_err();
    assert!(e.to_string().contains("it is \"yes\""), "{e}");
    assert!(
        AdminAuth::from_lookup(|v| (v == "CANOPY_MQ_ADMIN_OPEN").then(|| "true".into())).is_ok()
    );
    let short = AdminAuth::from_lookup(|v| (v == "CANOPY_MQ_ADMIN_TOKEN").then(|| "short".into()))
        .unwrap_err();
    assert!(
        !short.to_string().contains("short"),
        "the token is never echoed: {short}"
    );
    assert!(format!("{:?}", AdminAuth::bearer(TOKEN).unwrap()).contains("***"));
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn admin_routes_refuse_calls_without_the_token(pool: PgPool) {
    let r = router(&pool);
    for token in [None, Some("wrong-token-of-some-length"), Some("")] {
        for (method, uri, body) in [
            ("GET", "/v1/admin/outbox/parked", None),
            ("POST", "/v1/admin/outbox/unpark", Some(r#"{"all":true}"#)),
            ("POST", "/v1/admin/outbox/skip", Some(r#"{"all":true}"#)),
            (
                "POST",
                "/v1/admin/events/replay",
                Some(r#"{"dead_lettered_only":true}"#),
            ),
        ] {
            let (status, json, _) = call(&r, method, uri, token, body).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {uri} {token:?}");
            assert_eq!(json["error"], "missing or invalid bearer token");
        }
    }
    let (status, json, _) = call(&r, "GET", "/v1/admin/outbox/parked", Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::OK, "{json}");
    assert_eq!(json["parked"], serde_json::json!([]));
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn bad_requests_get_a_4xx_with_a_json_error(pool: PgPool) {
    let r = router(&pool);
    let cases: &[(&str, &str, Option<&str>, StatusCode)] = &[
        (
            "POST",
            "/v1/admin/events/replay",
            Some("{not json"),
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/admin/events/replay",
            Some(r#"{"bogus":1}"#),
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/admin/events/replay",
            Some(r#"{"ids":["nope"]}"#),
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/admin/events/replay",
            Some("{}"),
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/admin/events/replay",
            Some(r#"{"ids":[]}"#),
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/admin/events/replay",
            Some(r#"{"subscription":"nobody"}"#),
            StatusCode::NOT_FOUND,
        ),
        (
            "POST",
            "/v1/admin/outbox/unpark",
            Some("{}"),
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/admin/outbox/unpark",
            Some(r#"{"ids":[],"all":false}"#),
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/admin/outbox/unpark",
            Some(r#"{"ids":["0190a0a0-0000-7000-8000-000000000000"],"all":true}"#),
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/admin/outbox/unpark",
            Some("[1,2]"),
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/admin/outbox/skip",
            Some("{}"),
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/admin/outbox/skip",
            Some(r#"{"ids":["not-a-uuid"]}"#),
            StatusCode::BAD_REQUEST,
        ),
        (
            "GET",
            "/v1/admin/outbox/parked?limit=lots",
            None,
            StatusCode::BAD_REQUEST,
        ),
        (
            "GET",
            "/v1/admin/outbox/parked?limit=-1",
            None,
            StatusCode::BAD_REQUEST,
        ),
        ("GET", "/v1/admin/nothing", None, StatusCode::NOT_FOUND),
    ];
    for (method, uri, body, want) in cases {
        let (status, json, text) = call(&r, method, uri, Some(TOKEN), *body).await;
        assert_eq!(status, *want, "{method} {uri} {body:?}: {text}");
        assert!(
            json["error"].is_string(),
            "{method} {uri}: not a JSON error: {text}"
        );
    }
    // A body without a JSON content type.
    let req = Request::builder()
        .method("POST")
        .uri("/v1/admin/outbox/unpark")
        .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"))
        .body(Body::from(r#"{"all":true}"#))
        .unwrap();
    let resp = r.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn parked_rows_are_listed_and_unparked_with_a_fresh_budget(pool: PgPool) {
    let publisher = Publisher::new(pool.clone());
    let a = EventEnvelope::new("orders.created", serde_json::json!({ "n": 1 }));
    let b = EventEnvelope::new("orders.created", serde_json::json!({ "n": 2 }));
    publisher.publish(&a).await.unwrap();
    publisher.publish(&b).await.unwrap();
    sqlx::query(
        "UPDATE event_outbox SET parked_at = now(), attempts = 10, last_error = 'broker nack'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let r = router(&pool);
    let (status, json, _) = call(
        &r,
        "GET",
        "/v1/admin/outbox/parked?limit=1",
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(json["parked"].as_array().unwrap().len(), 1);
    let (_, json, _) = call(&r, "GET", "/v1/admin/outbox/parked", Some(TOKEN), None).await;
    let parked = json["parked"].as_array().unwrap();
    assert_eq!(parked.len(), 2);
    assert_eq!(parked[0]["attempts"], 10);
    assert_eq!(parked[0]["last_error"], "broker nack");

    let body = format!(r#"{{"ids":["{}"]}}"#, a.id);
    let (status, json, _) = call(
        &r,
        "POST",
        "/v1/admin/outbox/unpark",
        Some(TOKEN),
        Some(&body),
    )
    .await;
    assert_eq!(
        (status, json["unparked"].as_u64()),
        (StatusCode::OK, Some(1))
    );
    let (attempts, parked): (i32, bool) =
        sqlx::query_as("SELECT attempts, parked_at IS NOT NULL FROM event_outbox WHERE id = $1")
            .bind(a.id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((attempts, parked), (0, false));
    let (_, json, _) = call(
        &r,
        "POST",
        "/v1/admin/outbox/unpark",
        Some(TOKEN),
        Some(r#"{"all":true}"#),
    )
    .await;
    assert_eq!(json["unparked"], 1);
}

/// Skip gives parked rows up: marked done, never published, `skipped_at`
/// set; a row that is not parked is left alone; the key behind goes on.
#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn parked_rows_are_skipped_and_only_parked_ones(pool: PgPool) {
    let publisher = Publisher::new(pool.clone());
    let head = EventEnvelope::new("orders.created", serde_json::json!({})).with_ordering_key("o-1");
    let next = EventEnvelope::new("orders.created", serde_json::json!({})).with_ordering_key("o-1");
    publisher.publish(&head).await.unwrap();
    publisher.publish(&next).await.unwrap();
    sqlx::query("UPDATE event_outbox SET parked_at = now(), attempts = 10 WHERE id = $1")
        .bind(head.id)
        .execute(&pool)
        .await
        .unwrap();
    let r = router(&pool);
    let body = format!(r#"{{"ids":["{}"]}}"#, next.id);
    let (status, json, _) = call(
        &r,
        "POST",
        "/v1/admin/outbox/skip",
        Some(TOKEN),
        Some(&body),
    )
    .await;
    assert_eq!(
        (status, json["skipped"].as_u64()),
        (StatusCode::OK, Some(0))
    );
    let (_, json, _) = call(&r, "GET", "/v1/admin/outbox/parked", Some(TOKEN), None).await;
    assert_eq!(json["parked"][0]["ordering"]["key"], "o-1");
    assert_eq!(json["parked"][0]["ordering"]["seq"], 1);
    let (status, json, _) = call(
        &r,
        "POST",
        "/v1/admin/outbox/skip",
        Some(TOKEN),
        Some(r#"{"all":true}"#),
    )
    .await;
    assert_eq!(
        (status, json["skipped"].as_u64()),
        (StatusCode::OK, Some(1))
    );
    let rows: Vec<(uuid::Uuid, bool, bool)> = sqlx::query_as(
        "SELECT id, published_at IS NOT NULL, skipped_at IS NOT NULL FROM event_outbox ORDER BY key_seq",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows, [(head.id, true, true), (next.id, false, false)]);
}

#[tokio::test]
async fn readyz_and_metrics_report_the_outbox_and_need_no_token() {
    let unready = || Readiness {
        ready: false,
        reasons: vec![UnreadyReason::PendingOverThreshold {
            pending: 12_000,
            threshold: 10_000,
        }],
        stats: Some(outbox::runtime::OutboxStats {
            pending: 12_000,
            oldest_unpublished_age_secs: 4.5,
            parked: 3,
            blocked: 0,
        }),
    };
    let r = AdminRouter::new(AdminAuth::bearer(TOKEN).unwrap())
        .readiness(unready)
        .build();
    let (status, json, _) = call(&r, "GET", "/readyz", None, None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(json["ready"], false);
    assert_eq!(
        json["reasons"][0],
        "12000 outbox rows pending (threshold 10000)"
    );
}

/// A subscription that "replays" one row per listed id, and remembers the
/// limit it was asked for.
struct EchoTarget {
    limit: std::sync::Mutex<Option<u32>>,
}

impl outbox::admin::ReplayTarget for EchoTarget {
    fn subscription(&self) -> &str {
        "echo"
    }

    fn replay<'a>(
        &'a self,
        filter: &'a outbox::core::ports::InboxFilter,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<outbox::admin::ReplayPage, outbox::StoreError>>
                + Send
                + 'a,
        >,
    > {
        *self.limit.lock().unwrap() = filter.limit;
        let results = filter
            .ids
            .iter()
            .flatten()
            .take(filter.limit.unwrap_or(100) as usize)
            .map(|id| (*id, outbox::core::subscriber::ReplayOutcome::Applied))
            .collect();
        Box::pin(async move {
            Ok(outbox::admin::ReplayPage {
                results,
                released: Vec::new(),
                next: None,
            })
        })
    }

    fn skip<'a>(
        &'a self,
        ids: &'a [uuid::Uuid],
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<outbox::admin::ReplayPage, outbox::StoreError>>
                + Send
                + 'a,
        >,
    > {
        let results = ids
            .iter()
            .map(|id| (*id, outbox::core::subscriber::ReplayOutcome::Skipped))
            .collect();
        Box::pin(async move {
            Ok(outbox::admin::ReplayPage {
                results,
                released: Vec::new(),
                next: None,
            })
        })
    }

    fn list<'a>(
        &'a self,
        _filter: &'a outbox::admin::InboxFilter,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<
                    Output = Result<Vec<outbox::core::ports::InboxRow>, outbox::StoreError>,
                > + Send
                + 'a,
        >,
    > {
        Box::pin(async { Ok(Vec::new()) })
    }

    fn stats(&self) -> outbox::admin::SubscriberStats {
        outbox::admin::SubscriberStats::default()
    }

    fn counts(
        &self,
        _window: std::time::Duration,
        _cap: u32,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<outbox::admin::InboxCounts, outbox::StoreError>>
                + Send
                + '_,
        >,
    > {
        Box::pin(async { Ok(outbox::admin::InboxCounts::default()) })
    }
}

#[tokio::test]
async fn dead_lettered_events_are_skipped_by_subscription_and_ids() {
    let echo = std::sync::Arc::new(EchoTarget {
        limit: Default::default(),
    });
    let r = AdminRouter::new(AdminAuth::bearer(TOKEN).unwrap())
        .subscriber(echo)
        .build();
    let id = uuid::Uuid::now_v7();
    let body = format!(r#"{{"subscription":"echo","ids":["{id}"]}}"#);
    let (status, _, _) = call(&r, "POST", "/v1/admin/events/skip", None, Some(&body)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, json, _) = call(
        &r,
        "POST",
        "/v1/admin/events/skip",
        Some(TOKEN),
        Some(&body),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{json}");
    assert_eq!(json["results"][0]["event_id"], id.to_string());
    assert_eq!(json["results"][0]["outcome"], "skipped");
    assert_eq!(json["results"][0]["subscription"], "echo");
    for (bad, want) in [
        (
            r#"{"subscription":"echo","ids":[]}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            r#"{"ids":["00000000-0000-0000-0000-000000000000"]}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            r#"{"subscription":"nobody","ids":["00000000-0000-0000-0000-000000000000"]}"#,
            StatusCode::NOT_FOUND,
        ),
    ] {
        let (status, json, _) =
            call(&r, "POST", "/v1/admin/events/skip", Some(TOKEN), Some(bad)).await;
        assert_eq!(status, want, "{bad}: {json}");
        assert!(json["error"].is_string(), "{json}");
    }
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn the_admin_surface_edges_answer_in_json_with_the_right_status(pool: PgPool) {
    let echo = std::sync::Arc::new(EchoTarget {
        limit: Default::default(),
    });
    let r = AdminRouter::new(AdminAuth::bearer(TOKEN).unwrap())
        .outbox(PgOutboxStore::new(pool.clone()))
        .subscriber(echo.clone())
        .build();
    // The token is checked before the body is read: a body that never ends
    // still gets its 401 at once.
    let endless = futures_lite::stream::pending::<Result<Vec<u8>, std::io::Error>>();
    let req = Request::builder()
        .method("POST")
        .uri("/v1/admin/outbox/unpark")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(endless))
        .unwrap();
    let resp = tokio::time::timeout(std::time::Duration::from_secs(5), r.clone().oneshot(req))
        .await
        .expect("answered without reading the body")
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    // The scheme is case-insensitive (RFC 7235).
    let req = Request::builder()
        .uri("/v1/admin/outbox/parked")
        .header(header::AUTHORIZATION, format!("bearer {TOKEN}"))
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        r.clone().oneshot(req).await.unwrap().status(),
        StatusCode::OK
    );
    // A wrong method: 405 with a JSON error.
    let (status, json, text) = call(&r, "GET", "/v1/admin/events/replay", Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{text}");
    assert!(json["error"].is_string(), "{text}");
    // An over-limit body: 413, JSON.
    let huge = format!(r#"{{"ids":["{}"]}}"#, "x".repeat(3 << 20));
    let (status, json, text) = call(
        &r,
        "POST",
        "/v1/admin/events/replay",
        Some(TOKEN),
        Some(&huge),
    )
    .await;
    assert_eq!(
        status,
        StatusCode::PAYLOAD_TOO_LARGE,
        "{}",
        &text[..text.len().min(200)]
    );
    assert!(json["error"].is_string());
    // 150 listed ids are all replayed, none cut at the default limit of 100.
    let ids: Vec<String> = (0..150)
        .map(|_| format!("\"{}\"", uuid::Uuid::now_v7()))
        .collect();
    let body = format!(r#"{{"ids":[{}]}}"#, ids.join(","));
    let (status, json, text) = call(
        &r,
        "POST",
        "/v1/admin/events/replay",
        Some(TOKEN),
        Some(&body),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(json["results"].as_array().unwrap().len(), 150);
    assert_eq!(*echo.limit.lock().unwrap(), Some(150));
    // A replay by ids reaches every id listed: nothing more matches, even
    // with a smaller limit asked for (issue 25: it said `more`).
    let (_, json, text) = call(
        &r,
        "POST",
        "/v1/admin/events/replay",
        Some(TOKEN),
        Some(&format!(r#"{{"ids":[{}],"limit":2}}"#, ids[..2].join(","))),
    )
    .await;
    assert_eq!(
        (json["limit"].as_u64(), json["more"].as_bool()),
        (Some(2), Some(false)),
        "{text}"
    );
    // A database failure: 503 that names no database internals.
    pool.close().await;
    let (status, json, text) = call(&r, "GET", "/v1/admin/outbox/parked", Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
    assert_eq!(json["error"], "the database is unavailable; retry later");
}

/// `uri` with `Host: host` (when given), answered by `router`: status and
/// headers.
async fn call_host(
    router: &axum::Router,
    uri: &str,
    host: Option<&str>,
) -> (StatusCode, axum::http::HeaderMap) {
    let mut req = Request::builder().method("GET").uri(uri);
    if let Some(host) = host {
        req = req.header(header::HOST, host);
    }
    let resp = router
        .clone()
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .unwrap();
    (resp.status(), resp.headers().clone())
}

/// An open surface answers loopback `Host` names and the allowed ones only
/// (a page in an operator's browser reaching a sidecar on localhost through
/// a name of its own, by DNS rebinding, is refused); with a token, any
/// host. Probes and scrapes answer every host.
#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn an_open_surface_answers_loopback_and_allowed_hosts_only(pool: PgPool) {
    let open = |auth: AdminAuth| {
        AdminRouter::new(auth)
            .outbox(PgOutboxStore::new(pool.clone()))
            .console(outbox_admin::ConsoleSettings::default())
            .build()
    };
    let r = open(AdminAuth::open_insecure());
    for host in [
        "localhost",
        "localhost:8080",
        "LOCALHOST.:8080",
        "127.0.0.1:8080",
        "127.1.2.3",
        "[::1]:8080",
    ] {
        let (status, _) = call_host(&r, "/v1/admin/outbox/parked", Some(host)).await;
        assert_eq!(status, StatusCode::OK, "{host}");
    }
    for host in [
        Some("evil.example"),
        Some("evil.example:8080"),
        Some("localhost.evil.example"),
        Some("127.0.0.1.evil.example"),
        Some("10.0.0.5:8080"),
        None,
    ] {
        for uri in ["/v1/admin/outbox/parked", "/admin", "/admin/login"] {
            let (status, _) = call_host(&r, uri, host).await;
            assert_eq!(status, StatusCode::FORBIDDEN, "{uri} {host:?}");
        }
    }
    for uri in ["/readyz", "/metrics"] {
        let (status, _) = call_host(&r, uri, Some("10.0.0.5:8080")).await;
        assert_ne!(status, StatusCode::FORBIDDEN, "{uri}");
    }
    let allowed = open(
        AdminAuth::open_insecure()
            .allow_hosts(["Admin.Internal"])
            .unwrap(),
    );
    let (status, _) = call_host(
        &allowed,
        "/v1/admin/outbox/parked",
        Some("admin.internal:80"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = call_host(&allowed, "/v1/admin/outbox/parked", Some("evil.example")).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    // With a token the host does not matter; the token does.
    let (status, _) = call_host(
        &router(&pool),
        "/v1/admin/outbox/parked",
        Some("evil.example"),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // From the environment: open needs CANOPY_MQ_ADMIN_OPEN=true and no
    // token; the allow-list is read then.
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        AdminAuth::from_lookup(move |v| {
            pairs
                .iter()
                .find(|(k, _)| *k == v)
                .map(|(_, value)| (*value).to_owned())
        })
    };
    let from_env = open(
        env(&[
            ("CANOPY_MQ_ADMIN_OPEN", "true"),
            ("CANOPY_MQ_ADMIN_ALLOWED_HOSTS", "a.internal, b.internal"),
        ])
        .unwrap(),
    );
    let (status, _) = call_host(&from_env, "/v1/admin/outbox/parked", Some("b.internal")).await;
    assert_eq!(status, StatusCode::OK);
    let e = env(&[
        ("CANOPY_MQ_ADMIN_OPEN", "true"),
        ("CANOPY_MQ_ADMIN_ALLOWED_HOSTS", "a.internal:8080"),
    ])
    .unwrap_err();
    assert!(
        e.to_string().starts_with("CANOPY_MQ_ADMIN_ALLOWED_HOSTS="),
        "{e}"
    );
}

/// Every answer carries the security headers, the console's pages, its
/// unknown routes and refusals, and the JSON routes alike.
#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn every_answer_carries_the_security_headers(pool: PgPool) {
    let r = AdminRouter::new(AdminAuth::bearer(TOKEN).unwrap())
        .outbox(PgOutboxStore::new(pool.clone()))
        .console(outbox_admin::ConsoleSettings::default())
        .build();
    for uri in [
        "/admin/login",
        "/admin/nope",
        "/admin/dead/s/not-a-uuid",
        "/admin/parked/not-a-uuid",
        "/nope",
        "/v1/admin/outbox/parked",
        "/readyz",
    ] {
        let (status, headers) = call_host(&r, uri, Some("localhost")).await;
        for (name, value) in [
            ("x-content-type-options", "nosniff"),
            ("x-frame-options", "DENY"),
            ("referrer-policy", "no-referrer"),
            ("cache-control", "no-store"),
        ] {
            assert_eq!(
                headers.get(name).and_then(|v| v.to_str().ok()),
                Some(value),
                "{uri} ({status}) lacks {name}"
            );
        }
        let csp = headers
            .get("content-security-policy")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        assert!(
            csp.contains("default-src 'none'") && csp.contains("frame-ancestors 'none'"),
            "{uri} ({status}): {csp:?}"
        );
    }
}
