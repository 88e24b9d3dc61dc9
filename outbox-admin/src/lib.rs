//! The admin HTTP surface and operator console of the
//! [`outbox`](https://docs.rs/outbox) crate, as an axum [`Router`] a service
//! mounts beside its own routes:
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/admin/events/replay` | re-run the handler for unprocessed inbox rows (by ids or filter), budget reset |
//! | `POST /v1/admin/events/skip` | mark dead-lettered inbox rows of a subscription processed without their effect, releasing their keys' held rows in order |
//! | `GET /v1/admin/outbox/parked?limit=N` | list parked outbox rows |
//! | `POST /v1/admin/outbox/unpark` | unpark `{"ids":[…]}` or `{"all":true}`, budget reset |
//! | `POST /v1/admin/outbox/skip` | skip parked rows `{"ids":[…]}` or `{"all":true}`: given up, never published, their ordering keys go on |
//! | `GET /readyz` | readiness of the drainer and every subscription (200 or 503, with reasons) |
//! | `GET /metrics` | Prometheus text from the exporter ([`AdminRouter::metrics`]): gauges, counters, histograms |
//! | `/admin` | the operator console ([`AdminRouter::console`]) |
//!
//! `/v1/admin/*` requires `Authorization: Bearer <token>` (compared in
//! constant time); the router refuses to build without a token unless told
//! explicitly to run open ([`AdminAuth::open_insecure`]). `/readyz` and
//! `/metrics` are open, as probes and scrapers expect. Every error is JSON
//! (`{"error": "…"}`) with a 4xx for the caller's mistakes and a 503 when the
//! database is unavailable; nothing panics on bad input.
//!
//! ```no_run
//! # async fn demo(outbox: outbox::Outbox) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_admin::{AdminAuth, AdminRouter, ConsoleSettings, install_prometheus_recorder};
//! let router = AdminRouter::for_outbox(&outbox, AdminAuth::from_env()?) // CANOPY_MQ_ADMIN_TOKEN
//!     .metrics(install_prometheus_recorder()?)
//!     .console(ConsoleSettings::default())
//!     .build();
//! // axum::serve(listener, router) in the service's own server.
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

// The README's example compiles (`cargo test --doc -p outbox-admin`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme {}

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
pub use metrics_exporter_prometheus::{BuildError, PrometheusHandle};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use uuid::Uuid;

mod console;

pub use console::{ACTION_BATCH, ACTION_MAX, ConsoleSettings};

use outbox::admin::{self, ReplayTarget};
use outbox::core::ports::{InboxFilter, ParkedFilter, UnparkSelector};
use outbox::core::ports::{LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX};
use outbox::core::stats::Readiness;
use outbox::core::subscriber::ReplayOutcome;
use outbox::error::{ConfigError, StoreError};
use outbox::{Outbox, PgOutboxStore};

/// Variable holding the admin bearer token.
pub const ADMIN_TOKEN_VAR: &str = "CANOPY_MQ_ADMIN_TOKEN";
/// Variable that, set to `true`, allows an admin surface without a token.
pub const ADMIN_OPEN_VAR: &str = "CANOPY_MQ_ADMIN_OPEN";
/// Variable naming the `Host` names an open admin surface answers besides
/// the loopback ones (comma-separated host names or addresses, no port).
pub const ADMIN_ALLOWED_HOSTS_VAR: &str = "CANOPY_MQ_ADMIN_ALLOWED_HOSTS";
/// Shortest token accepted.
pub const TOKEN_MIN_BYTES: usize = 16;

/// How admin routes authenticate callers.
///
/// An open surface (no token) answers only requests whose `Host` is a
/// loopback name (`localhost`, `127.0.0.0/8`, `::1`) or one of its allowed
/// hosts ([`allow_hosts`](Self::allow_hosts),
/// `CANOPY_MQ_ADMIN_ALLOWED_HOSTS`): a page in an operator's browser cannot
/// reach a sidecar on localhost through a name of its own (DNS rebinding).
#[derive(Clone)]
pub struct AdminAuth {
    /// SHA-256 of the token; `None` runs open.
    token_digest: Option<[u8; 32]>,
    /// The hosts an open surface answers besides loopback, lowercased.
    allowed_hosts: Vec<String>,
}

impl std::fmt::Debug for AdminAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = if self.token_digest.is_some() {
            "bearer(***)"
        } else {
            "open"
        };
        f.debug_struct("AdminAuth")
            .field("mode", &mode)
            .field("allowed_hosts", &self.allowed_hosts)
            .finish()
    }
}

impl AdminAuth {
    /// Requires `Authorization: Bearer <token>`; the token must be at least
    /// [`TOKEN_MIN_BYTES`] long.
    pub fn bearer(token: &str) -> Result<Self, ConfigError> {
        if token.trim().len() < TOKEN_MIN_BYTES {
            return Err(ConfigError::Invalid {
                var: ADMIN_TOKEN_VAR.into(),
                value: "***".into(),
                rule: format!("must be at least {TOKEN_MIN_BYTES} bytes"),
            });
        }
        Ok(Self {
            token_digest: Some(Sha256::digest(token.trim().as_bytes()).into()),
            allowed_hosts: Vec::new(),
        })
    }

    /// No authentication at all: only for a surface reachable by operators
    /// alone (a sidecar port on localhost, say). It answers loopback `Host`
    /// names only, unless [`allow_hosts`](Self::allow_hosts) names more.
    pub fn open_insecure() -> Self {
        Self {
            token_digest: None,
            allowed_hosts: Vec::new(),
        }
    }

    /// The same, also answering these `Host` names when open (host names or
    /// addresses without a port, compared without case). Each must be
    /// non-blank and hold no space, control character, `/`, `@` or port.
    ///
    /// ```
    /// use outbox_admin::AdminAuth;
    /// let auth = AdminAuth::open_insecure().allow_hosts(["admin.internal"]).unwrap();
    /// assert!(AdminAuth::open_insecure().allow_hosts(["evil.example:80"]).is_err());
    /// # let _ = auth;
    /// ```
    pub fn allow_hosts(
        mut self,
        hosts: impl IntoIterator<Item = impl AsRef<str>>,
    ) -> Result<Self, ConfigError> {
        for host in hosts {
            let host = host.as_ref().trim();
            let bracketed = host.starts_with('[') && host.ends_with(']');
            if host.is_empty()
                || host
                    .chars()
                    .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '/' | '@'))
                || (!bracketed && host.contains(':'))
            {
                return Err(ConfigError::Invalid {
                    var: ADMIN_ALLOWED_HOSTS_VAR.into(),
                    value: host.escape_debug().to_string(),
                    rule: "each must be a host name or address without a port, \
                           comma-separated (an IPv6 address in brackets)"
                        .into(),
                });
            }
            self.allowed_hosts.push(host.to_ascii_lowercase());
        }
        Ok(self)
    }

    /// Whether a request naming `host` (its `Host` header or authority) is
    /// answered: always with a token; when open, only for a loopback name
    /// or an allowed host.
    fn serves_host(&self, host: Option<&str>) -> bool {
        if self.token_digest.is_some() {
            return true;
        }
        let Some(name) = host.map(host_name) else {
            return false;
        };
        let name = name.to_ascii_lowercase();
        is_loopback_name(&name) || self.allowed_hosts.contains(&name)
    }

    /// From `CANOPY_MQ_ADMIN_TOKEN`; without it, fails unless
    /// `CANOPY_MQ_ADMIN_OPEN=true` says to run open.
    pub fn from_env() -> Result<Self, ConfigError> {
        outbox::config::from_process_env(|lookup| Self::from_lookup(lookup))
    }

    /// Like [`from_env`](Self::from_env), reading variables through `lookup`.
    /// A token that is set is used (and judged) whatever
    /// `CANOPY_MQ_ADMIN_OPEN` says; open needs `CANOPY_MQ_ADMIN_OPEN=true`
    /// and no token, and then answers loopback hosts and those of
    /// `CANOPY_MQ_ADMIN_ALLOWED_HOSTS`.
    ///
    /// ```
    /// use outbox_admin::AdminAuth;
    /// let open = |v: &str| (v == "CANOPY_MQ_ADMIN_OPEN").then(|| "true".to_owned());
    /// assert!(AdminAuth::from_lookup(open).is_ok());
    /// assert!(AdminAuth::from_lookup(|_| None).is_err());
    /// ```
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        match (lookup(ADMIN_TOKEN_VAR), lookup(ADMIN_OPEN_VAR)) {
            (Some(token), _) => Self::bearer(&token),
            (None, Some(open)) if open.trim() == "true" => {
                let hosts = lookup(ADMIN_ALLOWED_HOSTS_VAR).unwrap_or_default();
                let auth = Self::open_insecure()
                    .allow_hosts(hosts.split(',').map(str::trim).filter(|h| !h.is_empty()))?;
                tracing::warn!(
                    allowed_hosts = ?auth.allowed_hosts,
                    "admin surface runs without authentication ({ADMIN_OPEN_VAR}=true): \
                     it answers loopback Host names and the allowed hosts only"
                );
                Ok(auth)
            }
            (None, open) => Err(ConfigError::Invalid {
                var: ADMIN_TOKEN_VAR.into(),
                value: String::new(),
                rule: format!(
                    "must be set (or set {ADMIN_OPEN_VAR}=true to run the admin surface open; \
                     it is {})",
                    open.map_or("unset".into(), |v| format!("{v:?}"))
                ),
            }),
        }
    }

    fn allows(&self, headers: &HeaderMap) -> bool {
        if self.token_digest.is_none() {
            return true;
        }
        let Some(given) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim_start().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token)
        else {
            return false;
        };
        self.allows_token(given)
    }

    /// Whether `given` is the token (any token when running open).
    fn allows_token(&self, given: &str) -> bool {
        let Some(expected) = self.token_digest else {
            return true;
        };
        // Equal-length digests, compared without an early exit.
        let given: [u8; 32] = Sha256::digest(given.trim().as_bytes()).into();
        given
            .iter()
            .zip(expected.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

/// The host of a `Host` value: `[::1]:8080` → `[::1]`, `a.b:80` → `a.b`.
fn host_name(host: &str) -> &str {
    let host = host.trim();
    if host.starts_with('[') {
        return host.find(']').map_or(host, |end| &host[..=end]);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

/// `localhost`, an address of `127.0.0.0/8`, or `[::1]`.
fn is_loopback_name(name: &str) -> bool {
    let name = name.strip_suffix('.').unwrap_or(name);
    if name == "localhost" {
        return true;
    }
    let bare = name
        .strip_prefix('[')
        .and_then(|n| n.strip_suffix(']'))
        .unwrap_or(name);
    bare.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
}

type ReadinessProbe = Arc<dyn Fn() -> Readiness + Send + Sync>;

/// Builds the admin [`Router`].
pub struct AdminRouter {
    auth: AdminAuth,
    outbox: Option<PgOutboxStore>,
    readiness: Option<ReadinessProbe>,
    metrics: Option<PrometheusHandle>,
    targets: BTreeMap<String, Arc<dyn ReplayTarget>>,
    console: Option<ConsoleSettings>,
}

/// Names what is mounted; never the admin token.
impl std::fmt::Debug for AdminRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminRouter")
            .field("outbox", &self.outbox.is_some())
            .field("readiness", &self.readiness.is_some())
            .field("metrics", &self.metrics.is_some())
            .field("subscriptions", &self.targets.keys().collect::<Vec<_>>())
            .field("console", &self.console.is_some())
            .finish_non_exhaustive()
    }
}

#[derive(Clone)]
struct AppState {
    auth: AdminAuth,
    outbox: Option<PgOutboxStore>,
    readiness: Option<ReadinessProbe>,
    metrics: Option<PrometheusHandle>,
    targets: Arc<BTreeMap<String, Arc<dyn ReplayTarget>>>,
}

impl AdminRouter {
    /// A router authenticating admin calls with `auth`.
    pub fn new(auth: AdminAuth) -> Self {
        Self {
            auth,
            outbox: None,
            readiness: None,
            metrics: None,
            targets: BTreeMap::new(),
            console: None,
        }
    }

    /// A router for everything `outbox` runs: its store (parked rows), the
    /// drainer's readiness, and every subscription (replay, skip, its
    /// readiness), behind `auth`; add metrics or the console, then `build`.
    pub fn for_outbox(outbox: &Outbox, auth: AdminAuth) -> Self {
        let mut router = Self::new(auth)
            .outbox(outbox.outbox_store())
            .readiness(outbox.drainer().readiness_probe());
        for target in outbox.replay_targets() {
            router = router.subscriber(target);
        }
        router
    }

    /// Serves `/metrics` from this exporter (see
    /// [`install_prometheus_recorder`]): the outbox gauges, the drainer's
    /// and subscribers' counters and histograms
    /// ([`outbox::telemetry`] lists them). Without it `/metrics` is a 404.
    pub fn metrics(mut self, handle: PrometheusHandle) -> Self {
        self.metrics = Some(handle);
        self
    }

    /// Serves parked-row listing and unpark on this outbox.
    pub fn outbox(mut self, store: PgOutboxStore) -> Self {
        self.outbox = Some(store);
        self
    }

    /// Serves `/readyz` from this probe (see
    /// [`outbox::DrainerHandle::readiness_probe`]).
    pub fn readiness(mut self, probe: impl Fn() -> Readiness + Send + Sync + 'static) -> Self {
        self.readiness = Some(Arc::new(probe));
        self
    }

    /// Serves replay (and counters) for this subscriber, under its queue name.
    pub fn subscriber(mut self, target: Arc<dyn ReplayTarget>) -> Self {
        self.targets
            .insert(target.subscription().to_owned(), target);
        self
    }

    /// Serves the operator console under `/admin` (see [`ConsoleSettings`]):
    /// sign in with the admin token at `/admin/login`.
    pub fn console(mut self, settings: ConsoleSettings) -> Self {
        self.console = Some(settings);
        self
    }

    /// The router.
    pub fn build(self) -> Router {
        let state = AppState {
            auth: self.auth,
            outbox: self.outbox,
            readiness: self.readiness,
            metrics: self.metrics,
            targets: Arc::new(self.targets),
        };
        // The token is checked before a request's body is read or parsed.
        let admin = Router::new()
            .route("/v1/admin/events/replay", post(replay))
            .route("/v1/admin/events/skip", post(skip_events))
            .route("/v1/admin/outbox/parked", get(list_parked))
            .route("/v1/admin/outbox/unpark", post(unpark))
            .route("/v1/admin/outbox/skip", post(skip))
            .route_layer(axum::middleware::from_fn_with_state(
                state.clone(),
                require_token,
            ))
            .route_layer(axum::middleware::from_fn_with_state(
                state.clone(),
                served_host,
            ));
        let console = match self.console {
            Some(settings) => console::routes(state.clone(), settings).route_layer(
                axum::middleware::from_fn_with_state(state.clone(), served_host),
            ),
            None => Router::new(),
        };
        Router::new()
            .merge(admin)
            .route("/readyz", get(readyz))
            .route("/metrics", get(metrics))
            .fallback(|| async { error(StatusCode::NOT_FOUND, "no such route") })
            .method_not_allowed_fallback(|| async {
                error(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "method not allowed on this route",
                )
            })
            .with_state(state)
            .merge(console)
            .layer(axum::middleware::map_response(secure_headers))
    }
}

/// Every answer's security headers, where the route did not set its own:
/// not sniffed, not framed, not cached, no referrer, nothing loaded.
async fn secure_headers(mut r: Response) -> Response {
    let h = r.headers_mut();
    let set = [
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-store"),
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; frame-ancestors 'none'",
        ),
    ];
    for (name, value) in set {
        if !h.contains_key(&name) {
            h.insert(name, HeaderValue::from_static(value));
        }
    }
    r
}

/// Answers 403 when the surface runs open and the request names a host
/// that is neither loopback nor allowed (see [`AdminAuth`]).
async fn served_host(
    State(state): State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| request.uri().authority().map(|a| a.as_str()));
    if state.auth.serves_host(host) {
        return next.run(request).await;
    }
    tracing::warn!(
        host = host.map(|h| h.escape_debug().to_string()),
        "open admin surface refused a request for a host that is not loopback nor allowed"
    );
    error(
        StatusCode::FORBIDDEN,
        "this admin surface runs without a token and answers loopback hosts only \
         (or those of CANOPY_MQ_ADMIN_ALLOWED_HOSTS)",
    )
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: &'a str,
}

fn error(status: StatusCode, message: &str) -> Response {
    (status, Json(ErrorBody { error: message })).into_response()
}

/// A 503 that says what failed, not the database's own text (which is
/// logged).
fn store_error(e: &StoreError) -> Response {
    tracing::warn!(error = %e, "admin call failed on the database");
    let what = if e.is_unavailable() {
        "the database is unavailable; retry later"
    } else {
        "the database refused the operation; see the service's log"
    };
    error(StatusCode::SERVICE_UNAVAILABLE, what)
}

fn json_rejection(r: &JsonRejection) -> Response {
    let status = match r.status() {
        s @ (StatusCode::PAYLOAD_TOO_LARGE | StatusCode::UNSUPPORTED_MEDIA_TYPE) => s,
        _ => StatusCode::BAD_REQUEST,
    };
    error(status, &r.body_text())
}

/// Answers 401 unless the caller is authorized, before the body is read.
async fn require_token(
    State(state): State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if state.auth.allows(request.headers()) {
        return next.run(request).await;
    }
    let mut r = error(StatusCode::UNAUTHORIZED, "missing or invalid bearer token");
    r.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

#[derive(Serialize)]
struct ReplayResult {
    event_id: Uuid,
    subscription: String,
    #[serde(flatten)]
    outcome: ReplayOutcome,
}

/// A page's outcomes as the routes answer them.
fn replay_results(subscription: &str, outcomes: Vec<(Uuid, ReplayOutcome)>) -> Vec<ReplayResult> {
    outcomes
        .into_iter()
        .map(|(event_id, outcome)| ReplayResult {
            event_id,
            subscription: subscription.to_owned(),
            outcome,
        })
        .collect()
}

/// Why a replay is refused (it names no rows, or lists too many); a list
/// of ids raises the limit to its length (none cut silently at the
/// default).
fn bounded_replay(filter: &mut InboxFilter) -> Result<(), String> {
    if filter.ids.is_none()
        && filter.subscription.is_none()
        && filter.routing_key.is_none()
        && !filter.dead_lettered_only
    {
        return Err(
            "say which rows to replay: ids, subscription, routing_key or dead_lettered_only".into(),
        );
    }
    if filter.ids.as_ref().is_some_and(Vec::is_empty) {
        return Err("ids is empty".into());
    }
    // Listed ids are all replayed (none cut silently at the default limit).
    if let Some(ids) = &filter.ids {
        if ids.len() > LIST_LIMIT_MAX as usize {
            return Err(format!(
                "ids lists {} events; at most {LIST_LIMIT_MAX} per call",
                ids.len()
            ));
        }
        filter.limit = Some(filter.limit.unwrap_or(0).max(ids.len() as u32));
    }
    Ok(())
}

async fn replay(
    State(state): State<AppState>,
    body: Result<Json<InboxFilter>, JsonRejection>,
) -> Response {
    let mut filter = match body {
        Ok(Json(f)) => f,
        Err(r) => return json_rejection(&r),
    };
    if let Err(refused) = bounded_replay(&mut filter) {
        return error(StatusCode::BAD_REQUEST, &refused);
    }
    let limit = filter
        .limit
        .unwrap_or(LIST_LIMIT_DEFAULT)
        .clamp(1, LIST_LIMIT_MAX);
    let targets: Vec<&Arc<dyn ReplayTarget>> = match &filter.subscription {
        Some(name) => match state.targets.get(name) {
            Some(t) => vec![t],
            None => {
                return error(
                    StatusCode::NOT_FOUND,
                    &format!("no subscriber for subscription {name:?} is mounted here"),
                );
            }
        },
        None => state.targets.values().collect(),
    };
    if targets.is_empty() {
        return error(StatusCode::NOT_FOUND, "no subscriber is mounted here");
    }
    let mut results = Vec::new();
    let mut released = Vec::new();
    let mut next = BTreeMap::new();
    for target in targets {
        match target.replay(&filter).await {
            Ok(page) => {
                if let Some(cursor) = page.next {
                    next.insert(target.subscription().to_owned(), cursor);
                }
                let sub = target.subscription();
                results.extend(replay_results(sub, page.results));
                released.extend(replay_results(sub, page.released));
            }
            Err(e) => {
                // What was replayed before the failure is reported; what
                // was not is still as it was (dead-lettered, findable).
                tracing::warn!(error = %e, replayed = results.len(), "replay stopped on the database");
                let body = serde_json::json!({
                    "error": "the database failed part-way; the rows not listed are unchanged, run the same request again",
                    "results": results,
                });
                return (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
            }
        }
    }
    tracing::info!(replayed = results.len(), "inbox rows replayed by operator");
    // `more`: rows past the limit match; `next`, per subscription, is the
    // `after` that replays them (past the rows that failed again).
    Json(serde_json::json!({
        "results": results,
        "released": released,
        "limit": limit,
        "more": !next.is_empty(),
        "next": next,
    }))
    .into_response()
}

/// `POST /v1/admin/events/skip`'s body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SkipEvents {
    subscription: String,
    ids: Vec<Uuid>,
}

async fn skip_events(
    State(state): State<AppState>,
    body: Result<Json<SkipEvents>, JsonRejection>,
) -> Response {
    let request = match body {
        Ok(Json(r)) => r,
        Err(r) => return json_rejection(&r),
    };
    if request.ids.is_empty() || request.ids.len() > LIST_LIMIT_MAX as usize {
        return error(
            StatusCode::BAD_REQUEST,
            &format!("ids must list 1 to {LIST_LIMIT_MAX} events"),
        );
    }
    let Some(target) = state.targets.get(&request.subscription) else {
        return error(
            StatusCode::NOT_FOUND,
            &format!(
                "no subscriber for subscription {:?} is mounted here",
                request.subscription
            ),
        );
    };
    match target.skip(&request.ids).await {
        Ok(page) => Json(serde_json::json!({
            "results": replay_results(&request.subscription, page.results),
            "released": replay_results(&request.subscription, page.released),
        }))
        .into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "skip stopped on the database");
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the database failed; rows already skipped stay skipped, run the same request again",
            )
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ParkedQuery {
    limit: Option<u32>,
}

async fn list_parked(
    State(state): State<AppState>,
    query: Result<Query<ParkedQuery>, QueryRejection>,
) -> Response {
    let Some(store) = &state.outbox else {
        return error(StatusCode::NOT_FOUND, "no outbox is mounted here");
    };
    let limit = match query {
        Ok(Query(q)) => q.limit.unwrap_or(100),
        Err(r) => return error(StatusCode::BAD_REQUEST, &r.body_text()),
    };
    match admin::list_parked(store, &ParkedFilter::page(limit, None)).await {
        Ok(rows) => Json(serde_json::json!({ "parked": rows })).into_response(),
        Err(e) => store_error(&e),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UnparkBody {
    #[serde(default)]
    ids: Option<Vec<Uuid>>,
    #[serde(default)]
    all: bool,
}

async fn unpark(
    State(state): State<AppState>,
    body: Result<Json<UnparkBody>, JsonRejection>,
) -> Response {
    parked_action(&state, body, ParkedAction::Unpark).await
}

async fn skip(
    State(state): State<AppState>,
    body: Result<Json<UnparkBody>, JsonRejection>,
) -> Response {
    parked_action(&state, body, ParkedAction::Skip).await
}

/// What an operator does to the parked rows a request names.
#[derive(Clone, Copy)]
enum ParkedAction {
    Unpark,
    Skip,
}

/// Unpark or skip: the selector from the body, the admin operation, and
/// `{"unparked": n}` or `{"skipped": n}`.
async fn parked_action(
    state: &AppState,
    body: Result<Json<UnparkBody>, JsonRejection>,
    action: ParkedAction,
) -> Response {
    let Some(store) = &state.outbox else {
        return error(StatusCode::NOT_FOUND, "no outbox is mounted here");
    };
    let selector = match selector(body) {
        Ok(s) => s,
        Err(r) => return *r,
    };
    let (done, answer) = match action {
        ParkedAction::Unpark => (admin::unpark(store, &selector).await, "unparked"),
        ParkedAction::Skip => (admin::skip(store, &selector).await, "skipped"),
    };
    match done {
        Ok(n) => Json(serde_json::json!({ answer: n })).into_response(),
        Err(e) => store_error(&e),
    }
}

/// The parked rows an unpark or skip names: a non-empty `ids` list or
/// `"all": true`, or the 4xx to answer.
fn selector(
    body: Result<Json<UnparkBody>, JsonRejection>,
) -> Result<UnparkSelector, Box<Response>> {
    Ok(match body {
        Ok(Json(UnparkBody {
            ids: Some(ids),
            all: false,
        })) if !ids.is_empty() => UnparkSelector::Ids(ids),
        Ok(Json(UnparkBody {
            ids: None,
            all: true,
        })) => UnparkSelector::All,
        Ok(_) => {
            return Err(Box::new(error(
                StatusCode::BAD_REQUEST,
                "give either a non-empty \"ids\" list or \"all\": true",
            )));
        }
        Err(r) => return Err(Box::new(json_rejection(&r))),
    })
}

/// The producer half's readiness (when a probe is set) and every served
/// subscriber's: ready only when none has a reason not to be.
async fn readyz(State(state): State<AppState>) -> Response {
    let outbox = state.readiness.as_ref().map(|probe| probe());
    let mut reasons: Vec<String> = outbox
        .iter()
        .flat_map(|r| r.reasons.iter().map(ToString::to_string))
        .collect();
    for target in state.targets.values() {
        reasons.extend(target.readiness_reasons().iter().map(ToString::to_string));
    }
    let ready = reasons.is_empty() && outbox.as_ref().is_none_or(|r| r.ready);
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let stats = outbox.and_then(|r| r.stats);
    (
        status,
        Json(serde_json::json!({ "ready": ready, "reasons": reasons, "stats": stats })),
    )
        .into_response()
}

/// Buckets (seconds) of every `*_seconds` histogram the library records.
pub const DURATION_BUCKETS: &[f64] = &[
    0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0,
];

/// Installs the Prometheus exporter as the process's `metrics` recorder
/// (histograms ending in `_seconds` get [`DURATION_BUCKETS`]) and returns
/// the handle [`AdminRouter::metrics`] renders. Call it once, at boot,
/// before anything records; it fails if a recorder is installed already.
///
/// ```no_run
/// # fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_admin::{AdminAuth, AdminRouter, install_prometheus_recorder};
/// let metrics = install_prometheus_recorder()?;
/// let router = AdminRouter::new(AdminAuth::from_env()?).metrics(metrics).build();
/// # Ok(()) }
/// ```
pub fn install_prometheus_recorder() -> Result<PrometheusHandle, BuildError> {
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), DURATION_BUCKETS)?
        .install_recorder()
}

async fn metrics(State(state): State<AppState>) -> Response {
    let Some(handle) = &state.metrics else {
        return error(
            StatusCode::NOT_FOUND,
            "no metrics recorder: see outbox_admin::install_prometheus_recorder",
        );
    };
    // Without the exporter's own upkeep task, histograms are drained here.
    handle.run_upkeep();
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        handle.render(),
    )
        .into_response()
}
