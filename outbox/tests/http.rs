//! The admin HTTP surface: authentication, JSON errors for bad input (never
//! a 500), parked-row listing and unpark on a real database, readiness and
//! metrics. Replay through the route is in `subscribe.rs`, next to a real
//! subscriber.

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use outbox::core::stats::{Readiness, UnreadyReason};
use outbox::http::{AdminAuth, AdminRouter};
use outbox::{EventEnvelope, PgOutboxStore, Publisher};
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

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn admin_routes_refuse_calls_without_the_token(pool: PgPool) {
    let r = router(&pool);
    for token in [None, Some("wrong-token-of-some-length"), Some("")] {
        for (method, uri, body) in [
            ("GET", "/v1/admin/outbox/parked", None),
            ("POST", "/v1/admin/outbox/unpark", Some(r#"{"all":true}"#)),
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

#[sqlx::test(migrator = "outbox::MIGRATOR")]
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

#[sqlx::test(migrator = "outbox::MIGRATOR")]
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

#[tokio::test]
async fn readyz_and_metrics_report_the_outbox_and_need_no_token() {
    let unready = || Readiness {
        ready: false,
        reasons: vec![UnreadyReason::PendingOverThreshold {
            pending: 12_000,
            threshold: 10_000,
        }],
        stats: Some(outbox::OutboxStats {
            pending: 12_000,
            oldest_unpublished_age_secs: 4.5,
            parked: 3,
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
    let (status, _, text) = call(&r, "GET", "/metrics", None, None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        text.contains("# TYPE canopy_mq_outbox_pending gauge\ncanopy_mq_outbox_pending 12000\n"),
        "{text}"
    );
    assert!(
        text.contains("canopy_mq_outbox_oldest_unpublished_age_seconds 4.5\n"),
        "{text}"
    );
    assert!(text.contains("canopy_mq_outbox_parked 3\n"), "{text}");
    assert!(text.contains("canopy_mq_outbox_ready 0\n"), "{text}");
}
