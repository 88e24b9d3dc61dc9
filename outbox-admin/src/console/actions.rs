//! The console's actions: unpark and skip parked rows, replay and skip
//! dead-lettered events, on one row, a selection or everything a filter
//! matches; always through a confirmation that says how many rows, then
//! in batches of [`ACTION_BATCH`] with what each row became.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use tokio::sync::mpsc;
use uuid::Uuid;

use super::filter::{Filter, Form};
use super::html::{esc, hidden, page, table};
use super::lists::{dead_matching, parked_matching, parked_where};
use super::session::{Session, same};
use super::{ACTION_BATCH, ACTION_MAX, Console, html, problem};
use outbox::admin;
use outbox::core::ports::{InboxFilter, ParkedFilter, UnparkSelector};
use outbox::core::subscriber::ReplayOutcome;

/// The session and the form of a POST whose CSRF token is the session's,
/// or the answer that refuses it.
pub(super) fn checked(
    console: &Console,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<(Session, Form), Box<Response>> {
    let Some(session) = console.sessions.of(headers) else {
        return Err(Box::new(problem(
            StatusCode::UNAUTHORIZED,
            None,
            "Your session ended; sign in again.",
        )));
    };
    let form = Form::parse(body);
    if !form.get("csrf").is_some_and(|t| same(t, &session.csrf)) {
        tracing::warn!("console: a form without this session's CSRF token was refused");
        return Err(Box::new(problem(
            StatusCode::FORBIDDEN,
            Some(&session),
            "This form is not from this session; reload the page.",
        )));
    }
    Ok((session, form))
}

/// What an action does, on which list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Unpark,
    SkipParked,
    Replay,
    SkipDead,
}

impl Action {
    fn parse(kind: &str, action: &str) -> Option<Self> {
        match (kind, action) {
            ("parked", "unpark") => Some(Self::Unpark),
            ("parked", "skip") => Some(Self::SkipParked),
            ("dead", "replay") => Some(Self::Replay),
            ("dead", "skip") => Some(Self::SkipDead),
            _ => None,
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Self::Unpark | Self::SkipParked => "parked",
            Self::Replay | Self::SkipDead => "dead",
        }
    }

    fn verb(self) -> &'static str {
        match self {
            Self::Unpark => "unpark",
            Self::Replay => "replay",
            Self::SkipParked | Self::SkipDead => "skip",
        }
    }

    fn what(self, n: usize) -> String {
        match self {
            Self::Unpark => format!(
                "Unpark {n} parked row(s): the drainer publishes them again, with a fresh attempts budget."
            ),
            Self::SkipParked => format!(
                "Skip {n} parked row(s): they are given up and never published; their ordering keys go on."
            ),
            Self::Replay => format!(
                "Replay {n} dead-lettered event(s): the handler runs again, with a fresh attempts budget."
            ),
            Self::SkipDead => format!(
                "Skip {n} dead-lettered event(s): marked processed without their effect; their keys' held events go on."
            ),
        }
    }
}

fn buttons(kind: &str, scope: &str, total: Option<usize>) -> String {
    let verbs: &[&str] = if kind == "parked" {
        &["unpark", "skip"]
    } else {
        &["replay", "skip"]
    };
    let mut out = String::new();
    for verb in verbs {
        let label = match total {
            Some(n) => format!("{verb} all {n} matching"),
            None => format!("{verb} {scope}"),
        };
        let _ = write!(
            out,
            "<button name=op value=\"{verb}:{scope}\">{}</button> ",
            esc(&label)
        );
    }
    out
}

/// The list's table inside the form that acts on its selection or on
/// everything its filter matches (the table alone when read-only).
pub(super) fn selection_form(
    console: &Console,
    s: &Session,
    kind: &str,
    f: &Filter,
    table: &str,
    total: usize,
) -> String {
    if console.settings.read_only {
        return format!("{table}<p class=note>Read-only console: no actions.</p>");
    }
    let mut out = format!(
        "<form method=post action=/admin/confirm>{}{}",
        hidden("csrf", &s.csrf),
        hidden("kind", kind)
    );
    for (k, v) in f.pairs() {
        out.push_str(&hidden(k, &v));
    }
    let _ = write!(
        out,
        "<p>{}{}</p>{table}</form>",
        buttons(kind, "selected", None),
        buttons(kind, "all", Some(total))
    );
    out
}

/// The actions on the one row a page shows.
pub(super) fn one_row_form(console: &Console, s: &Session, kind: &str, id: &str) -> String {
    if console.settings.read_only {
        return String::new();
    }
    format!(
        "<form method=post action=/admin/confirm>{}{}{}<p>{}</p></form>",
        hidden("csrf", &s.csrf),
        hidden("kind", kind),
        hidden("id", id),
        buttons(kind, "selected", None)
    )
}

/// The rows a form names: its `id`s, or what its filter matches now.
async fn targets(
    console: &Console,
    action: Action,
    scope: &str,
    form: &Form,
) -> Result<Vec<String>, String> {
    let ids: Vec<String> = if scope == "all" {
        let f = Filter::from_form(form)?;
        match action.kind() {
            "parked" => parked_matching(console, &f)
                .await?
                .iter()
                .map(|r| r.id.to_string())
                .collect(),
            _ => dead_matching(console, &f)
                .await?
                .iter()
                .map(|r| format!("{}/{}", r.subscription, r.event_id))
                .collect(),
        }
    } else {
        form.all("id")
            .map(str::to_owned)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect()
    };
    if ids.is_empty() {
        return Err("No row is selected.".into());
    }
    if ids.len() > ACTION_MAX {
        return Err(format!(
            "{} rows; one action touches at most {ACTION_MAX}.",
            ids.len()
        ));
    }
    for id in &ids {
        parse_id(action, id)?;
    }
    Ok(ids)
}

/// A row's key: a parked row's id, or `subscription/event id`.
fn parse_id(action: Action, id: &str) -> Result<(Option<String>, Uuid), String> {
    let bad = || format!("{id:?} is not a row of this list.");
    match action.kind() {
        "parked" => Ok((None, Uuid::parse_str(id).map_err(|_| bad())?)),
        _ => {
            let (sub, id) = id.rsplit_once('/').ok_or_else(bad)?;
            Ok((
                Some(sub.to_owned()),
                Uuid::parse_str(id).map_err(|_| bad())?,
            ))
        }
    }
}

fn action_of(
    console: &Console,
    s: &Session,
    form: &Form,
) -> Result<(Action, String), Box<Response>> {
    if console.settings.read_only {
        return Err(Box::new(problem(
            StatusCode::FORBIDDEN,
            Some(s),
            "This console is read-only.",
        )));
    }
    let (verb, scope) = form
        .get("op")
        .and_then(|op| op.split_once(':'))
        .unwrap_or(("", ""));
    let verb = form.get("action").unwrap_or(verb);
    match Action::parse(form.get("kind").unwrap_or(""), verb) {
        Some(a) if matches!(scope, "" | "selected" | "all") => Ok((a, scope.to_owned())),
        _ => Err(Box::new(problem(
            StatusCode::BAD_REQUEST,
            Some(s),
            "Unknown action.",
        ))),
    }
}

/// A checked POST's session, its action and the rows it names (`scope`,
/// when given, overrides the form's), or the answer that refuses it.
async fn requested(
    console: &Console,
    headers: &HeaderMap,
    body: &Bytes,
    scope: Option<&str>,
) -> Result<(Session, Action, Vec<String>), Box<Response>> {
    let (session, form) = checked(console, headers, body)?;
    let (action, asked) = action_of(console, &session, &form)?;
    match targets(console, action, scope.unwrap_or(&asked), &form).await {
        Ok(ids) => Ok((session, action, ids)),
        Err(m) => Err(Box::new(problem(
            StatusCode::BAD_REQUEST,
            Some(&session),
            &m,
        ))),
    }
}

pub(super) async fn confirm(
    State(console): State<Console>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (session, action, ids) = match requested(&console, &headers, &body, None).await {
        Ok(x) => x,
        Err(r) => return *r,
    };
    let mut body = format!(
        "<p><strong>{}</strong></p><form method=post action=/admin/run>",
        esc(&action.what(ids.len()))
    );
    body.push_str(&hidden("csrf", &session.csrf));
    body.push_str(&hidden("kind", action.kind()));
    body.push_str(&hidden("action", action.verb()));
    for id in &ids {
        body.push_str(&hidden("id", id));
    }
    let _ = write!(
        body,
        "<button id=confirm>{} {} row(s)</button> <a href=/admin/{}>cancel</a></form><ul>",
        action.verb(),
        ids.len(),
        action.kind()
    );
    for id in ids.iter().take(20) {
        let _ = write!(body, "<li>{}</li>", esc(id));
    }
    if ids.len() > 20 {
        let _ = write!(body, "<li>and {} more</li>", ids.len() - 20);
    }
    body.push_str("</ul>");
    html(
        StatusCode::OK,
        page("Confirm", Some(&session.csrf), None, &body),
    )
}

pub(super) async fn run(
    State(console): State<Console>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    // The confirmation listed the rows: run exactly those.
    let (session, action, ids) = match requested(&console, &headers, &body, Some("selected")).await
    {
        Ok(x) => x,
        Err(r) => return *r,
    };
    // The page goes out as the action runs: a line per batch as it is done
    // (no script needed: a browser shows a page as it arrives), then what
    // each row became. The action runs to its end on a task of its own, so
    // an operator who leaves the page leaves no batch half done.
    let shell = page("Action", Some(&session.csrf), None, PROGRESS_HERE);
    let (head, tail) = shell
        .split_once(PROGRESS_HERE)
        .map(|(h, t)| (h.to_owned(), t.to_owned()))
        .unwrap_or_default();
    let (out, chunks) = mpsc::channel(4);
    tokio::spawn(async move {
        let _ = out.send(head).await;
        let report = match action.kind() {
            "parked" => run_parked(&console, action, &ids, &out).await,
            _ => run_dead(&console, action, &ids, &out).await,
        };
        tracing::info!(
            action = action.verb(),
            list = action.kind(),
            rows = ids.len(),
            "console action run"
        );
        let _ = out.send(report.html(action)).await;
        let _ = out.send(tail).await;
    });
    super::secured(Response::new(Body::from_stream(Chunks(chunks))))
}

/// Where the action's page takes its progress and its report.
const PROGRESS_HERE: &str = "\u{1}progress\u{1}";

/// An action's page, chunk by chunk as it is written.
struct Chunks(mpsc::Receiver<String>);

impl futures_core::Stream for Chunks {
    type Item = Result<String, std::convert::Infallible>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|chunk| chunk.map(Ok))
    }
}

/// What an action did: each row's outcome, and why it stopped early, if it
/// did (rows not listed are as they were). Its progress, a line per batch,
/// went out as it went.
#[derive(Default)]
struct Report {
    rows: Vec<(String, String)>,
    stopped: Option<String>,
}

impl Report {
    /// The report's end of the page.
    fn html(&self, action: Action) -> String {
        let mut body = String::new();
        if let Some(stopped) = &self.stopped {
            let _ = write!(body, "<p class=bad>{}</p>", esc(stopped));
        }
        let rows: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|(id, became)| vec![esc(id), esc(became)])
            .collect();
        body.push_str(&table(&["row", "became"], &rows));
        let _ = write!(
            body,
            "<p><a href=/admin/{}>back to the list</a></p>",
            action.kind()
        );
        body
    }
}

/// Sends a batch's line of progress.
async fn progress(out: &mpsc::Sender<String>, line: String) {
    let _ = out.send(format!("<p class=note>{}</p>", esc(&line))).await;
}

async fn run_parked(
    console: &Console,
    action: Action,
    ids: &[String],
    out: &mpsc::Sender<String>,
) -> Report {
    let mut report = Report::default();
    let Some(store) = &console.app.outbox else {
        report.stopped = Some("No outbox is mounted here.".into());
        return report;
    };
    let uuids: Vec<Uuid> = ids
        .iter()
        .filter_map(|id| parse_id(action, id).ok())
        .map(|(_, u)| u)
        .collect();
    // Which of them are parked (the others are reported as not parked).
    let wanted: BTreeSet<Uuid> = uuids.iter().copied().collect();
    let select = ParkedFilter {
        ids: Some(wanted.iter().copied().collect()),
        ..ParkedFilter::default()
    };
    let parked: BTreeSet<Uuid> = match parked_where(console, &select, wanted.len(), |_| true).await
    {
        Ok(rows) => rows.iter().map(|r| r.id).collect(),
        Err(m) => {
            report.stopped = Some(m);
            return report;
        }
    };
    let batches = uuids.len().div_ceil(ACTION_BATCH);
    for (i, batch) in uuids.chunks(ACTION_BATCH).enumerate() {
        let selector = UnparkSelector::Ids(batch.to_vec());
        let done = match action {
            Action::Unpark => admin::unpark(store, &selector).await,
            _ => admin::skip(store, &selector).await,
        };
        let n = match done {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "console: parked-row action stopped on the database");
                report.stopped = Some(format!(
                    "The database failed at batch {} of {batches}; the rows not listed below are unchanged. Run it again.",
                    i + 1
                ));
                return report;
            }
        };
        let line = format!(
            "batch {} of {batches}: {n} of {} row(s) changed",
            i + 1,
            batch.len()
        );
        progress(out, line).await;
        let became = if action == Action::Unpark {
            "unparked: queued for publishing"
        } else {
            "skipped: never published"
        };
        for id in batch {
            let what = if parked.contains(id) {
                became
            } else {
                "was not parked: nothing done"
            };
            report.rows.push((id.to_string(), what.to_owned()));
        }
    }
    report
}

fn outcome(o: &ReplayOutcome) -> String {
    match o {
        ReplayOutcome::Applied => "applied".into(),
        ReplayOutcome::AlreadyProcessed => "already processed: the handler did not run".into(),
        ReplayOutcome::Failed { error } => format!("failed again: {error}"),
        ReplayOutcome::Undecodable { reason } => format!("not an envelope: {reason}"),
        ReplayOutcome::Held => "held behind an earlier event of its key".into(),
        ReplayOutcome::Skipped => "skipped: marked processed without its effect".into(),
    }
}

async fn run_dead(
    console: &Console,
    action: Action,
    ids: &[String],
    out: &mpsc::Sender<String>,
) -> Report {
    let mut by_sub: BTreeMap<String, Vec<Uuid>> = BTreeMap::new();
    for id in ids {
        if let Ok((Some(sub), u)) = parse_id(action, id) {
            by_sub.entry(sub).or_default().push(u);
        }
    }
    let mut report = Report::default();
    let batches: usize = by_sub
        .values()
        .map(|v| v.len().div_ceil(ACTION_BATCH))
        .sum();
    let mut batch_no = 0;
    for (sub, uuids) in &by_sub {
        let Some(target) = console.app.targets.get(sub) else {
            report.stopped = Some(format!(
                "No subscriber for subscription {sub:?} is mounted here."
            ));
            return report;
        };
        for batch in uuids.chunks(ACTION_BATCH) {
            batch_no += 1;
            let page = match action {
                Action::Replay => {
                    let filter = InboxFilter {
                        ids: Some(batch.to_vec()),
                        subscription: Some(sub.clone()),
                        limit: Some(batch.len() as u32),
                        ..InboxFilter::default()
                    };
                    target.replay(&filter).await
                }
                _ => target.skip(batch).await,
            };
            let page = match page {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(error = %e, "console: dead-letter action stopped on the database");
                    report.stopped = Some(format!(
                        "The database failed at batch {batch_no} of {batches}; the rows not listed below are unchanged. Run it again."
                    ));
                    return report;
                }
            };
            let line = format!(
                "batch {batch_no} of {batches} ({sub}): {} row(s)",
                batch.len()
            );
            progress(out, line).await;
            let done: BTreeMap<Uuid, String> = page
                .results
                .iter()
                .map(|(id, o)| (*id, outcome(o)))
                .collect();
            for id in batch {
                let what = done
                    .get(id)
                    .cloned()
                    .unwrap_or_else(|| "not dead-lettered any more: nothing done".into());
                report.rows.push((format!("{sub}/{id}"), what));
            }
            for (id, o) in &page.released {
                report.rows.push((
                    format!("{sub}/{id}"),
                    format!("released behind it: {}", outcome(o)),
                ));
            }
        }
    }
    report
}
