//! The operator console: server-rendered pages under `/admin` for the
//! outbox's parked rows and the subscriptions' dead-lettered events, with
//! unpark, skip and replay on one row, a selection or everything a filter
//! matches. No script, no asset from outside the service.
//!
//! Security: the operator signs in with the admin bearer token
//! ([`super::AdminAuth`]); the console answers with a session cookie
//! (`HttpOnly`, `SameSite=Strict`, `Secure` unless
//! [`ConsoleSettings::insecure_cookie`]), so nothing in a page or a URL
//! carries the token. Every form carries the session's CSRF token and every
//! value on a page is HTML-escaped. [`ConsoleSettings::read_only`] leaves
//! the pages and takes the actions away. The actions are the library's
//! admin operations ([`outbox::admin::unpark`], [`outbox::admin::skip`],
//! [`super::ReplayTarget::replay`], [`super::ReplayTarget::skip`]), run
//! in batches of [`ACTION_BATCH`].

mod actions;
mod filter;
mod html;
mod lists;
mod session;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use super::AppState;
use html::{esc, hidden, page};
use session::{LOGIN_COOKIE, Session, Sessions};

/// Rows an action hands the admin operation at once.
pub const ACTION_BATCH: usize = 100;
/// Most rows one action touches.
pub const ACTION_MAX: usize = 10_000;

/// How the console runs.
#[derive(Debug, Clone, Default)]
pub struct ConsoleSettings {
    read_only: bool,
    insecure_cookie: bool,
}

impl ConsoleSettings {
    /// Pages only: no unpark, skip or replay.
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }

    /// Session cookies without `Secure`, for a console reached over plain
    /// HTTP on a trusted network (browsers keep `Secure` cookies over HTTP
    /// only for localhost).
    pub fn insecure_cookie(mut self, insecure: bool) -> Self {
        self.insecure_cookie = insecure;
        self
    }
}

#[derive(Clone)]
struct Console {
    app: AppState,
    sessions: Sessions,
    settings: ConsoleSettings,
}

/// The console's routes, merged into the admin router.
pub(super) fn routes(app: AppState, settings: ConsoleSettings) -> Router {
    let console = Console {
        app,
        sessions: Sessions::default(),
        settings,
    };
    Router::new()
        .route("/admin", get(lists::overview))
        .route("/admin/console.css", get(css))
        .route("/admin/login", get(login_form).post(login))
        .route("/admin/logout", post(logout))
        .route("/admin/parked", get(lists::parked))
        .route("/admin/parked/{id}", get(lists::parked_row))
        .route("/admin/dead", get(lists::dead))
        .route("/admin/dead/{subscription}/{id}", get(lists::dead_row))
        .route("/admin/confirm", post(actions::confirm))
        .route("/admin/run", post(actions::run))
        .with_state(console)
}

/// An HTML answer with the console's headers: no caching, no framing, no
/// script, nothing from elsewhere.
fn html(status: StatusCode, body: String) -> Response {
    secured((status, body).into_response())
}

/// `r` with the console's headers: HTML, and a CSP that lets nothing but
/// the console's own style sheet load. Not cached, not framed, not sniffed,
/// no referrer: the router's layer gives every answer those.
fn secured(mut r: Response) -> Response {
    let h = r.headers_mut();
    let set = [
        (header::CONTENT_TYPE, "text/html; charset=utf-8"),
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    ];
    for (name, value) in set {
        h.insert(name, HeaderValue::from_static(value));
    }
    r
}

/// A page saying what went wrong, with `status`.
fn problem(status: StatusCode, session: Option<&Session>, message: &str) -> Response {
    let body = format!(
        "<p class=bad>{}</p><p><a href=/admin>back to the overview</a></p>",
        esc(message)
    );
    html(
        status,
        page(
            "Something went wrong",
            session.map(|s| s.csrf.as_str()),
            None,
            &body,
        ),
    )
}

fn redirect(to: &'static str) -> Response {
    (StatusCode::SEE_OTHER, [(header::LOCATION, to)]).into_response()
}

/// The signed-in session, or the answer that sends the caller to sign in.
fn signed_in(console: &Console, headers: &HeaderMap) -> Result<Session, Box<Response>> {
    console
        .sessions
        .of(headers)
        .ok_or_else(|| Box::new(redirect("/admin/login")))
}

async fn css() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        html::CSS,
    )
        .into_response()
}

async fn login_form(State(console): State<Console>) -> Response {
    login_page(&console, StatusCode::OK, None)
}

/// The sign-in form, with a fresh login CSRF token in its own cookie.
fn login_page(console: &Console, status: StatusCode, message: Option<&str>) -> Response {
    let nonce = session::secret();
    let open = console.app.auth.token_digest.is_none();
    let field = if open {
        "<p class=note>This console runs without authentication.</p>".to_owned()
    } else {
        "<label>Admin token <input type=password name=token autocomplete=off autofocus></label> "
            .to_owned()
    };
    let message = message.map_or(String::new(), |m| format!("<p class=bad>{}</p>", esc(m)));
    let body = format!(
        "{message}<form method=post action=/admin/login>{}{field}<button>sign in</button></form>",
        hidden("login_csrf", &nonce)
    );
    let mut r = html(status, page("Sign in", None, None, &body));
    let cookie = session::set_cookie(
        LOGIN_COOKIE,
        &nonce,
        std::time::Duration::from_secs(3600),
        !console.settings.insecure_cookie,
    );
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().append(header::SET_COOKIE, v);
    }
    r
}

async fn login(
    State(console): State<Console>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let form = filter::Form::parse(&body);
    let nonce = session::cookie(&headers, LOGIN_COOKIE).unwrap_or_default();
    let given = form.get("login_csrf").unwrap_or_default();
    if nonce.is_empty() || !session::same(&nonce, given) {
        return login_page(
            &console,
            StatusCode::FORBIDDEN,
            Some("The sign-in form expired; sign in again."),
        );
    }
    if !console
        .app
        .auth
        .allows_token(form.get("token").unwrap_or_default())
    {
        tracing::warn!("console sign-in refused: wrong token");
        return login_page(
            &console,
            StatusCode::UNAUTHORIZED,
            Some("That token is not the admin token."),
        );
    }
    let id = console.sessions.open();
    let mut r = redirect("/admin");
    let secure = !console.settings.insecure_cookie;
    for c in [
        session::set_cookie(session::COOKIE, &id, session::SESSION_TTL, secure),
        session::set_cookie(LOGIN_COOKIE, "", std::time::Duration::ZERO, secure),
    ] {
        if let Ok(v) = HeaderValue::from_str(&c) {
            r.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    tracing::info!("console session opened");
    r
}

async fn logout(
    State(console): State<Console>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    if let Err(r) = actions::checked(&console, &headers, &body) {
        return *r;
    }
    console.sessions.close(&headers);
    let mut r = redirect("/admin/login");
    let c = session::set_cookie(
        session::COOKIE,
        "",
        std::time::Duration::ZERO,
        !console.settings.insecure_cookie,
    );
    if let Ok(v) = HeaderValue::from_str(&c) {
        r.headers_mut().append(header::SET_COOKIE, v);
    }
    r
}
