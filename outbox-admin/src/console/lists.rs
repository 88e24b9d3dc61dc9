//! The console's pages: the overview, the parked rows and the
//! dead-lettered events (lists with filters and paging, one row in full).

use std::fmt::Write as _;
use std::future::Future;
use std::time::Duration;

use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use uuid::Uuid;

use super::filter::{Filter, Form};
use super::html::{esc, esc_bytes, input, page, table, url};
use super::session::Session;
use super::{ACTION_MAX, Console, html, problem, signed_in};
use outbox::admin;
use outbox::core::ports::{
    InboxCursor, InboxFilter, InboxRow, OutboxStore, ParkedCursor, ParkedFilter, ParkedRow,
};
use outbox::envelope::EventEnvelope;
use outbox::error::StoreError;

/// The page size the lists read their rows in (oldest first).
pub const LIST_WINDOW: u32 = 1000;
/// Most rows a list reads of the outbox or of one subscription, a page of
/// [`LIST_WINDOW`] at a time; it stops sooner once more rows match than
/// one action may touch ([`ACTION_MAX`]).
pub const SCAN_MAX: usize = 100_000;
/// Rows on one page of a list.
pub const PAGE_ROWS: usize = 50;
/// What a page says when the database failed (the error is logged).
const UNAVAILABLE: &str = "The database did not answer; see the service's log.";
/// How often the overview refreshes itself.
const REFRESH_SECS: u32 = 10;

fn when(t: OffsetDateTime) -> String {
    t.format(&Rfc3339).unwrap_or_default()
}

fn age(t: OffsetDateTime) -> String {
    let secs = (OffsetDateTime::now_utc() - t).whole_seconds().max(0);
    match secs {
        s if s < 120 => format!("{s} s"),
        s if s < 7200 => format!("{} min", s / 60),
        s if s < 172_800 => format!("{} h", s / 3600),
        s => format!("{} d", s / 86_400),
    }
}

pub(super) async fn overview(State(console): State<Console>, headers: HeaderMap) -> Response {
    let session = match signed_in(&console, &headers) {
        Ok(s) => s,
        Err(r) => return *r,
    };
    let mut body = String::new();
    outbox_overview(&console, &mut body).await;
    subscriptions_overview(&console, &mut body).await;
    let _ = write!(body, "<p class=note>Refreshes every {REFRESH_SECS} s.</p>");
    html(
        StatusCode::OK,
        page("Overview", Some(&session.csrf), Some(REFRESH_SECS), &body),
    )
}

async fn outbox_overview(console: &Console, body: &mut String) {
    body.push_str("<h2>Outbox</h2>");
    let Some(store) = &console.app.outbox else {
        body.push_str("<p class=note>No outbox is mounted here.</p>");
        return;
    };
    let readiness = console.app.readiness.as_ref().map(|probe| probe());
    let ready = match &readiness {
        None => "<span class=note>no readiness probe mounted</span>".to_owned(),
        Some(r) if r.ready => "<span class=ok>ready</span>".to_owned(),
        Some(r) => {
            let why: Vec<String> = r.reasons.iter().map(|x| esc(&x.to_string())).collect();
            format!("<span class=bad>not ready: {}</span>", why.join("; "))
        }
    };
    match store.outbox_stats().await {
        Ok(s) => body.push_str(&table(
            &[
                "pending",
                "oldest unpublished",
                "parked",
                "blocked behind a parked row",
                "readiness",
            ],
            &[vec![
                s.pending.to_string(),
                format!("{:.0} s", s.oldest_unpublished_age_secs),
                format!("<a href=/admin/parked>{}</a>", s.parked),
                s.blocked.to_string(),
                ready,
            ]],
        )),
        Err(e) => {
            tracing::warn!(error = %e, "console: outbox stats failed");
            body.push_str("<p class=bad>The database did not answer; see the service's log.</p>");
        }
    }
}

async fn subscriptions_overview(console: &Console, body: &mut String) {
    body.push_str("<h2>Subscriptions</h2>");
    if console.app.targets.is_empty() {
        body.push_str("<p class=note>No subscriber is mounted here.</p>");
        return;
    }
    let mut rows = Vec::new();
    for (name, target) in console.app.targets.iter() {
        let s = target.stats();
        let (recent, retrying, dead) = match target.counts(RECENT, COUNT_CAP).await {
            Ok(c) => (
                count(c.processed_recently),
                count(c.retrying),
                format!(
                    "<a href=\"/admin/dead?subscription={}\">{}</a>",
                    esc(&url(name)),
                    count(c.dead_lettered)
                ),
            ),
            Err(e) => {
                tracing::warn!(error = %e, "console: counting inbox rows failed");
                let no = "<span class=bad>unavailable</span>".to_owned();
                (no.clone(), no.clone(), no)
            }
        };
        rows.push(vec![
            esc(name),
            recent,
            retrying,
            dead,
            s.duplicates.to_string(),
        ]);
    }
    body.push_str(&table(
        &[
            "subscription",
            "processed in the last hour",
            "retrying now",
            "dead-lettered now",
            "duplicates absorbed (this replica, since start)",
        ],
        &rows,
    ));
}

/// The overview's window for "processed in the last hour".
const RECENT: Duration = Duration::from_secs(3600);
/// The overview counts at most this many rows of a kind (it refreshes
/// itself: a count must stay cheap on a table of millions of rows).
const COUNT_CAP: u32 = 100_000;

/// A count, "or more" at the cap.
fn count(n: u64) -> String {
    if n >= u64::from(COUNT_CAP) {
        format!("{COUNT_CAP} or more")
    } else {
        n.to_string()
    }
}

fn dead_filter(subscription: Option<&str>) -> InboxFilter {
    InboxFilter {
        subscription: subscription.map(str::to_owned),
        dead_lettered_only: true,
        limit: Some(LIST_WINDOW),
        ..InboxFilter::default()
    }
}

/// Reads a list a page of [`LIST_WINDOW`] rows at a time, oldest first,
/// into `rows` the rows `keep` takes: `page(after)` reads the page after a
/// row's `cursor`. It reads at most [`SCAN_MAX`] rows, and stops once
/// `rows` holds `enough`.
async fn scan<R, C, Fut>(
    rows: &mut Vec<R>,
    enough: usize,
    mut page: impl FnMut(Option<C>) -> Fut,
    cursor: impl Fn(&R) -> C,
    keep: impl Fn(&R) -> bool,
) -> Result<(), StoreError>
where
    Fut: Future<Output = Result<Vec<R>, StoreError>>,
{
    let (mut after, mut scanned) = (None, 0);
    while scanned < SCAN_MAX && rows.len() < enough {
        let listed = page(after).await?;
        scanned += listed.len();
        let full = listed.len() >= LIST_WINDOW as usize;
        after = listed.last().map(&cursor);
        rows.extend(listed.into_iter().filter(|r| keep(r)));
        if !full {
            break;
        }
    }
    Ok(())
}

/// The parked rows a filter matches, oldest first (see [`scan`]), without
/// their envelopes, until more match than [`ACTION_MAX`]. The database
/// matches the payload field and sends no envelope, so a list costs the
/// same for small events and large ones.
pub(super) async fn parked_matching(
    console: &Console,
    f: &Filter,
) -> Result<Vec<ParkedRow>, String> {
    let select = ParkedFilter {
        payload_field: f.payload_field(),
        ..ParkedFilter::default()
    };
    parked_where(console, &select, ACTION_MAX + 1, |r| f.parked(r)).await
}

/// The parked rows `select` selects and `keep` takes, oldest first,
/// without their envelopes, until there are `enough`.
pub(super) async fn parked_where(
    console: &Console,
    select: &ParkedFilter,
    enough: usize,
    keep: impl Fn(&ParkedRow) -> bool,
) -> Result<Vec<ParkedRow>, String> {
    let Some(store) = &console.app.outbox else {
        return Err("No outbox is mounted here.".into());
    };
    let mut rows = Vec::new();
    let page = |after| {
        let filter = ParkedFilter {
            after,
            limit: LIST_WINDOW,
            omit_envelope: true,
            ..select.clone()
        };
        async move { admin::list_parked(store, &filter).await }
    };
    scan(&mut rows, enough, page, ParkedCursor::of, keep)
        .await
        .map_err(|e| {
            tracing::warn!(error = %e, "console: listing parked rows failed");
            UNAVAILABLE.to_owned()
        })?;
    rows.sort_by_key(|r| (r.enqueued_at, r.id));
    Ok(rows)
}

/// The dead-lettered events a filter matches, oldest first, with their
/// subscriptions, without their payloads: each subscription read as
/// [`scan`] reads, until more match than [`ACTION_MAX`] in all. The
/// database matches the payload field and sends no payload, so a list
/// costs the same for small events and large ones.
pub(super) async fn dead_matching(console: &Console, f: &Filter) -> Result<Vec<InboxRow>, String> {
    let mut rows = Vec::new();
    let payload_field = f.payload_field();
    for (name, target) in console.app.targets.iter() {
        if f.subscription.as_ref().is_some_and(|s| s != name) {
            continue;
        }
        let page = |after| {
            let filter = InboxFilter {
                after,
                payload_field: payload_field.clone(),
                omit_payload: true,
                ..dead_filter(Some(name))
            };
            async move { target.list(&filter).await }
        };
        scan(&mut rows, ACTION_MAX + 1, page, InboxCursor::of, |r| {
            f.dead(r)
        })
        .await
        .map_err(|e| {
            tracing::warn!(error = %e, "console: listing dead-lettered rows failed");
            UNAVAILABLE.to_owned()
        })?;
    }
    rows.sort_by_key(|r| (r.received_at, r.event_id));
    Ok(rows)
}

/// The filter form, keeping what was asked.
fn filter_form(action: &str, f: &Filter, with_subscription: bool) -> String {
    let v = |o: &Option<String>| o.clone().unwrap_or_default();
    let t = |o: &Option<OffsetDateTime>| o.map(when).unwrap_or_default();
    let mut out =
        format!("<form class=filters method=get action={action}><fieldset><legend>filter</legend>");
    if with_subscription {
        out.push_str(&input(
            "subscription",
            "subscription",
            &v(&f.subscription),
            "",
        ));
    }
    out.push_str(&input(
        "routing key",
        "routing_key",
        &v(&f.routing_key),
        "orders.* or exact",
    ));
    out.push_str(&input("error contains", "error", &v(&f.error), ""));
    out.push_str(&input("from", "from", &t(&f.from), "2026-12-04T00:00:00Z"));
    out.push_str(&input("to", "to", &t(&f.to), "RFC 3339"));
    if with_subscription {
        out.push_str(&input("payload field", "path", &v(&f.path), "customer.id"));
        out.push_str(&input("equals", "value", &v(&f.value), ""));
    }
    out.push_str("<button>apply</button></fieldset></form>");
    out
}

/// The query string's filter and page, or the page that says what is wrong.
fn asked(query: Option<String>) -> Result<(Filter, usize), String> {
    let form = Form::parse(query.unwrap_or_default().as_bytes());
    let page = form
        .text("page")
        .and_then(|p| p.parse().ok())
        .unwrap_or(0usize);
    Ok((Filter::from_form(&form)?, page))
}

/// "Rows a–b of n", links to the pages around, and the window's note.
fn pager(base: &str, f: &Filter, page_no: usize, total: usize) -> String {
    let pages = total.div_ceil(PAGE_ROWS).max(1);
    let mut query: String = form_urlencoded::Serializer::new(String::new())
        .extend_pairs(f.pairs())
        .finish();
    if !query.is_empty() {
        query.push('&');
    }
    let shown = if total > ACTION_MAX {
        format!("more than {ACTION_MAX}")
    } else {
        total.to_string()
    };
    let mut out = format!("<p>{shown} matching; page {} of {pages}", page_no + 1);
    if page_no > 0 {
        let _ = write!(
            out,
            " <a href=\"{base}?{}page={}\">previous</a>",
            esc(&query),
            page_no - 1
        );
    }
    if page_no + 1 < pages {
        let _ = write!(
            out,
            " <a href=\"{base}?{}page={}\">next</a>",
            esc(&query),
            page_no + 1
        );
    }
    let _ = write!(
        out,
        "</p><p class=note>Filters apply to the oldest {SCAN_MAX} rows of the outbox and of \
         each subscription (stopping past {ACTION_MAX} matches).</p>"
    );
    out
}

/// One of the two lists: its path under `/admin`, title and columns.
struct List {
    kind: &'static str,
    title: &'static str,
    head: [&'static str; 7],
    /// Filtered by subscription and payload field too.
    events: bool,
}

const PARKED: List = List {
    kind: "parked",
    title: "Parked outbox rows",
    head: [
        "",
        "id",
        "routing key",
        "ordering key",
        "attempts",
        "last error",
        "enqueued",
    ],
    events: false,
};

const DEAD: List = List {
    kind: "dead",
    title: "Dead-lettered events",
    head: [
        "",
        "event id",
        "subscription",
        "routing key",
        "attempts",
        "last error",
        "dead-lettered",
    ],
    events: true,
};

/// A list request's session, filter and page, or the answer that refuses it.
fn list_request(
    console: &Console,
    headers: &HeaderMap,
    query: Option<String>,
) -> Result<(Session, Filter, usize), Box<Response>> {
    let session = signed_in(console, headers)?;
    match asked(query) {
        Ok((f, page_no)) => Ok((session, f, page_no)),
        Err(m) => Err(Box::new(problem(
            StatusCode::BAD_REQUEST,
            Some(&session),
            &m,
        ))),
    }
}

/// A list's page: the filter form, the pager, and the page's rows in the
/// form that acts on them.
fn list_page<T>(
    console: &Console,
    session: &Session,
    list: &List,
    f: &Filter,
    page_no: usize,
    rows: &[T],
    cells: fn(&T) -> Vec<String>,
) -> Response {
    let base = format!("/admin/{}", list.kind);
    let cells: Vec<Vec<String>> = rows
        .iter()
        .skip(page_no * PAGE_ROWS)
        .take(PAGE_ROWS)
        .map(cells)
        .collect();
    let body = format!(
        "{}{}{}",
        filter_form(&base, f, list.events),
        pager(&base, f, page_no, rows.len()),
        super::actions::selection_form(
            console,
            session,
            list.kind,
            f,
            &table(&list.head, &cells),
            rows.len()
        ),
    );
    html(
        StatusCode::OK,
        page(list.title, Some(&session.csrf), None, &body),
    )
}

pub(super) async fn parked(
    State(console): State<Console>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Response {
    let (session, f, page_no) = match list_request(&console, &headers, q) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    match parked_matching(&console, &f).await {
        Ok(rows) => list_page(
            &console,
            &session,
            &PARKED,
            &f,
            page_no,
            &rows,
            parked_cells,
        ),
        Err(m) => problem(StatusCode::SERVICE_UNAVAILABLE, Some(&session), &m),
    }
}

fn parked_cells(r: &ParkedRow) -> Vec<String> {
    vec![
        format!(
            "<input type=checkbox name=id value={} aria-label=select>",
            r.id
        ),
        format!("<a href=/admin/parked/{id}>{id}</a>", id = r.id),
        esc(&r.routing_key),
        r.ordering
            .as_ref()
            .map_or(String::new(), |k| format!("{} #{}", esc(&k.key), k.seq)),
        r.attempts.to_string(),
        esc(r.last_error.as_deref().unwrap_or("")),
        format!("{} ago", age(r.enqueued_at)),
    ]
}

pub(super) async fn parked_row(
    State(console): State<Console>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let session = match signed_in(&console, &headers) {
        Ok(s) => s,
        Err(r) => return *r,
    };
    let Ok(id) = Uuid::parse_str(&id) else {
        return problem(
            StatusCode::BAD_REQUEST,
            Some(&session),
            "That is not an event id.",
        );
    };
    let Some(store) = &console.app.outbox else {
        let m = "No outbox is mounted here.";
        return problem(StatusCode::SERVICE_UNAVAILABLE, Some(&session), m);
    };
    let one = ParkedFilter {
        ids: Some(vec![id]),
        ..ParkedFilter::page(1, None)
    };
    let rows = match admin::list_parked(store, &one).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "console: reading a parked row failed");
            return problem(StatusCode::SERVICE_UNAVAILABLE, Some(&session), UNAVAILABLE);
        }
    };
    let Some(r) = rows.iter().find(|r| r.id == id) else {
        return problem(
            StatusCode::NOT_FOUND,
            Some(&session),
            "No parked row has that id (it may have been unparked).",
        );
    };
    let (headers, envelope) = envelope_cells(r.envelope.as_bytes());
    let mut body = table(
        &["field", "value"],
        &[
            vec!["id".into(), r.id.to_string()],
            vec!["routing key".into(), esc(&r.routing_key)],
            vec![
                "ordering key".into(),
                r.ordering
                    .as_ref()
                    .map_or("none".into(), |k| format!("{} #{}", esc(&k.key), k.seq)),
            ],
            vec!["attempts".into(), r.attempts.to_string()],
            vec![
                "last error".into(),
                format!("<pre>{}</pre>", esc(r.last_error.as_deref().unwrap_or(""))),
            ],
            vec!["enqueued".into(), when(r.enqueued_at)],
            vec!["parked".into(), when(r.parked_at)],
            vec!["headers".into(), headers],
            vec!["envelope".into(), envelope],
        ],
    );
    body.push_str(&super::actions::one_row_form(
        &console,
        &session,
        "parked",
        &r.id.to_string(),
    ));
    html(
        StatusCode::OK,
        page("Parked row", Some(&session.csrf), None, &body),
    )
}

pub(super) async fn dead(
    State(console): State<Console>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Response {
    let (session, f, page_no) = match list_request(&console, &headers, q) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    match dead_matching(&console, &f).await {
        Ok(rows) => list_page(&console, &session, &DEAD, &f, page_no, &rows, dead_cells),
        Err(m) => problem(StatusCode::SERVICE_UNAVAILABLE, Some(&session), &m),
    }
}

fn dead_cells(r: &InboxRow) -> Vec<String> {
    let key = format!("{}/{}", r.subscription, r.event_id);
    vec![
        format!(
            "<input type=checkbox name=id value=\"{}\" aria-label=select>",
            esc(&key)
        ),
        format!(
            "<a href=\"/admin/dead/{}/{}\">{}</a>",
            esc(&url(&r.subscription)),
            r.event_id,
            r.event_id
        ),
        esc(&r.subscription),
        esc(&r.routing_key),
        r.attempts.to_string(),
        esc(r.last_error.as_deref().unwrap_or("")),
        r.dead_lettered_at
            .map_or(String::new(), |t| format!("{} ago", age(t))),
    ]
}

pub(super) async fn dead_row(
    State(console): State<Console>,
    headers: HeaderMap,
    Path((subscription, id)): Path<(String, String)>,
) -> Response {
    let session = match signed_in(&console, &headers) {
        Ok(s) => s,
        Err(r) => return *r,
    };
    let Ok(id) = Uuid::parse_str(&id) else {
        return problem(
            StatusCode::BAD_REQUEST,
            Some(&session),
            "That is not an event id.",
        );
    };
    let Some(target) = console.app.targets.get(&subscription) else {
        return problem(
            StatusCode::NOT_FOUND,
            Some(&session),
            "No subscriber for that subscription is mounted here.",
        );
    };
    let filter = InboxFilter {
        ids: Some(vec![id]),
        ..dead_filter(Some(&subscription))
    };
    let row = match target.list(&filter).await {
        Ok(rows) => rows.into_iter().find(|r| r.event_id == id),
        Err(e) => {
            tracing::warn!(error = %e, "console: reading a dead-lettered row failed");
            return problem(StatusCode::SERVICE_UNAVAILABLE, Some(&session), UNAVAILABLE);
        }
    };
    let Some(r) = row else {
        return problem(
            StatusCode::NOT_FOUND,
            Some(&session),
            "No dead-lettered event has that id here (it may have been replayed).",
        );
    };
    let mut body = dead_row_table(&r);
    body.push_str(&super::actions::one_row_form(
        &console,
        &session,
        "dead",
        &format!("{}/{}", r.subscription, r.event_id),
    ));
    html(
        StatusCode::OK,
        page("Dead-lettered event", Some(&session.csrf), None, &body),
    )
}

/// An envelope's headers and the envelope itself, as two cells: decoded
/// when it is one, its bytes as text when it is not.
fn envelope_cells(bytes: &[u8]) -> (String, String) {
    match EventEnvelope::decode(bytes) {
        Ok(e) => {
            let headers: Vec<String> = e
                .headers
                .iter()
                .map(|(k, v)| format!("{}: {}", esc(k), esc(v)))
                .collect();
            let pretty = serde_json::to_string_pretty(&e).unwrap_or_default();
            (headers.join("<br>"), format!("<pre>{}</pre>", esc(&pretty)))
        }
        Err(why) => (
            String::new(),
            format!(
                "<p class=bad>not an envelope: {}</p><pre>{}</pre>",
                esc(&why.to_string()),
                esc_bytes(bytes)
            ),
        ),
    }
}

/// One dead-lettered row in full: its envelope and headers too.
fn dead_row_table(r: &InboxRow) -> String {
    let (headers, envelope) = envelope_cells(&r.payload);
    let mut rows = vec![
        vec!["event id".into(), r.event_id.to_string()],
        vec!["subscription".into(), esc(&r.subscription)],
        vec!["routing key".into(), esc(&r.routing_key)],
        vec!["attempts".into(), r.attempts.to_string()],
        vec![
            "last error".into(),
            format!("<pre>{}</pre>", esc(r.last_error.as_deref().unwrap_or(""))),
        ],
        vec!["received".into(), when(r.received_at)],
        vec![
            "dead-lettered".into(),
            r.dead_lettered_at.map(when).unwrap_or_default(),
        ],
        vec!["headers".into(), headers],
        vec!["envelope".into(), envelope],
    ];
    if let Some(k) = &r.ordering {
        rows.push(vec![
            "ordering key".into(),
            format!("{} #{}", esc(&k.key), k.seq),
        ]);
    }
    table(&["field", "value"], &rows)
}
