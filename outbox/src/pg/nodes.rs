//! A PostgreSQL node list, as libpq takes it: a URL naming several hosts
//! (`postgres://user@h1:5432,h2:5432/db?target_session_attrs=read-write`).
//! sqlx connects to one host; [`connect`] builds a pool that connects to the
//! first writable node of the list and follows the writable node when it
//! changes (a failover, a switchover, a primary demoted in place):
//!
//! - a new session is checked before the pool hands it out: one on a node
//!   that cannot write is closed, and the list is searched again;
//! - a watcher asks the current node once a
//!   [`WATCH_EVERY`] whether it can still write, on a session of its own,
//!   and searches the list when it cannot or does not answer;
//! - when the writable node changes, the pool's new sessions go to it, and
//!   every idle session opened before the change is closed instead of
//!   handed out, so no task stays on the old node;
//! - every pool the library derives from this one (the drainer's sessions,
//!   the inbox's control pool, the commit listener's session) follows it.
//!
//! With `target_session_attrs=any` (libpq's default) or a single host the
//! pool takes the first node that answers, as libpq does, and never moves.

use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection};

use crate::error::ConfigError;

/// How often the watcher asks the current node whether it can still write.
pub const WATCH_EVERY: Duration = Duration::from_secs(1);

/// How long one node may take to answer a search's connect and question.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// The variable the examples read the URL from, named in errors.
const URL_VAR: &str = "DATABASE_URL";

/// What a session must find on its node (libpq's `target_session_attrs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionAttrs {
    /// Any node that answers (the default).
    Any,
    /// A node whose sessions can write: not in recovery and not read-only
    /// by default (`read-write`).
    ReadWrite,
    /// A node not in recovery (`primary`).
    Primary,
}

/// A parsed node list: each node's connect options, in the URL's order,
/// and what a session must find.
#[derive(Debug, Clone)]
pub struct NodeList {
    nodes: Vec<PgConnectOptions>,
    attrs: SessionAttrs,
}

impl NodeList {
    /// Parses a URL of one or more hosts, separated by commas. Errors name
    /// `DATABASE_URL` and never show the password.
    ///
    /// ```
    /// use outbox::pg::nodes::{NodeList, SessionAttrs};
    /// let list = NodeList::parse(
    ///     "postgres://app:secret@10.0.0.1:5432,10.0.0.2:5433/orders?target_session_attrs=read-write",
    /// )?;
    /// assert_eq!(list.len(), 2);
    /// assert_eq!(list.attrs(), SessionAttrs::ReadWrite);
    /// let e = NodeList::parse("postgres://app:secret@h1,h2/db?target_session_attrs=standby").unwrap_err();
    /// assert!(!e.to_string().contains("secret"), "{e}");
    /// # Ok::<(), outbox::ConfigError>(())
    /// ```
    pub fn parse(url: &str) -> Result<Self, ConfigError> {
        let bad = |rule: &str| ConfigError::Invalid {
            var: URL_VAR.into(),
            value: crate::amqp::redact_url(url),
            rule: rule.to_owned(),
        };
        let (scheme, rest) = url
            .split_once("://")
            .filter(|(s, _)| *s == "postgres" || *s == "postgresql")
            .ok_or_else(|| bad("must be a postgres:// URL"))?;
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (userinfo, hosts) = match authority.rfind('@') {
            Some(at) => (&authority[..=at], &authority[at + 1..]),
            None => ("", authority),
        };
        let (tail, attrs) = take_session_attrs(tail).map_err(|rule| bad(&rule))?;
        let mut nodes = Vec::new();
        for host in hosts.split(',') {
            if host.trim().is_empty() {
                return Err(bad("names an empty host"));
            }
            let one = format!("{scheme}://{userinfo}{host}{tail}");
            let options: PgConnectOptions = one
                .parse()
                .map_err(|_| bad(&format!("cannot be read for host {host}")))?;
            nodes.push(options);
        }
        Ok(Self { nodes, attrs })
    }

    /// How many nodes it names.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether it names none (never, once parsed).
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// What a session must find on its node.
    pub fn attrs(&self) -> SessionAttrs {
        self.attrs
    }

    /// Each node's connect options, in order.
    pub fn nodes(&self) -> &[PgConnectOptions] {
        &self.nodes
    }
}

/// Takes `target_session_attrs` out of a URL's path and query (sqlx does
/// not know it): what is left, and what it asked.
fn take_session_attrs(tail: &str) -> Result<(String, SessionAttrs), String> {
    let Some((path, query)) = tail.split_once('?') else {
        return Ok((tail.to_owned(), SessionAttrs::Any));
    };
    let mut attrs = SessionAttrs::Any;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("target_session_attrs", value)) => {
                attrs = match value {
                    "any" => SessionAttrs::Any,
                    "read-write" => SessionAttrs::ReadWrite,
                    "primary" => SessionAttrs::Primary,
                    other => {
                        return Err(format!(
                            "target_session_attrs={other} is not supported: any, read-write \
                             or primary"
                        ));
                    }
                }
            }
            _ => kept.push(pair),
        }
    }
    let tail = if kept.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{}", kept.join("&"))
    };
    Ok((tail, attrs))
}

/// When a pool last moved to another node: a session older than that was
/// opened on the node it left.
#[derive(Debug)]
struct LastMove(Mutex<Instant>);

impl LastMove {
    fn now() -> Arc<Self> {
        Arc::new(Self(Mutex::new(Instant::now())))
    }

    fn mark(&self) {
        *self.0.lock().expect("not poisoned") = Instant::now();
    }

    /// Whether a session of `age` was opened before the last move.
    fn predates(&self, age: Duration) -> bool {
        age > self.0.lock().expect("not poisoned").elapsed()
    }

    /// `options` closing, instead of handing out, every idle session
    /// opened before the last move (by the session's age: no round trip).
    fn drops_older(self: &Arc<Self>, options: PgPoolOptions) -> PgPoolOptions {
        let last = self.clone();
        options.before_acquire(move |_, meta| {
            let stale = last.predates(meta.age);
            Box::pin(async move { Ok(!stale) })
        })
    }
}

/// What the pool's hooks and the watcher share.
#[derive(Debug)]
struct Follow {
    list: NodeList,
    /// The node the pool follows.
    current: Mutex<usize>,
    last_move: Arc<LastMove>,
    /// Wakes the watcher to search at once.
    search: tokio::sync::Notify,
}

impl Follow {
    fn moved_to(&self, index: usize) {
        let mut current = self.current.lock().expect("not poisoned");
        if *current != index {
            *current = index;
            self.last_move.mark();
        }
    }

    fn index(&self) -> usize {
        *self.current.lock().expect("not poisoned")
    }
}

/// Whether a session's node fits `attrs`; `Err` when it does not answer.
async fn fits(conn: &mut sqlx::PgConnection, attrs: SessionAttrs) -> Result<bool, sqlx::Error> {
    if attrs == SessionAttrs::Any {
        return Ok(true);
    }
    let (recovering, read_only): (bool, String) = sqlx::query_as(
        "SELECT pg_is_in_recovery(), current_setting('default_transaction_read_only')",
    )
    .fetch_one(conn)
    .await?;
    Ok(match attrs {
        SessionAttrs::Any => true,
        SessionAttrs::Primary => !recovering,
        SessionAttrs::ReadWrite => !recovering && read_only != "on",
    })
}

/// Asks node `index` whether it fits, on a connection of its own.
async fn probe(list: &NodeList, index: usize) -> bool {
    let attempt = async {
        let mut conn = list.nodes[index].connect().await?;
        let ok = fits(&mut conn, list.attrs).await;
        let _ = conn.close().await;
        ok
    };
    matches!(
        tokio::time::timeout(PROBE_TIMEOUT, attempt).await,
        Ok(Ok(true))
    )
}

/// The first node that fits, starting from the list's head.
async fn search(list: &NodeList) -> Option<usize> {
    for index in 0..list.len() {
        if probe(list, index).await {
            return Some(index);
        }
    }
    None
}

/// A pool over the nodes of `url` that follows the writable node (see the
/// module's docs), with sqlx's defaults otherwise; `options` sets the rest
/// (sizes, timeouts) as for any pool. Its watcher runs on the current tokio
/// runtime until the pool is closed ([`PgPool::close`]).
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = outbox::pg::nodes::connect(
///     "postgres://app@db1:5432,db2:5432/orders?target_session_attrs=read-write",
///     sqlx::postgres::PgPoolOptions::new().max_connections(20),
/// )
/// .await?;
/// let outbox = outbox::Outbox::builder(pool).start().await?;
/// # Ok(()) }
/// ```
pub async fn connect(url: &str, options: PgPoolOptions) -> Result<PgPool, ConnectError> {
    let list = NodeList::parse(url)?;
    let index = search(&list).await.ok_or(ConnectError::NoNode {
        nodes: list.len(),
        attrs: list.attrs,
    })?;
    let follow = Arc::new(Follow {
        current: Mutex::new(index),
        last_move: LastMove::now(),
        search: tokio::sync::Notify::new(),
        list,
    });
    let pool = guarded(options, &follow).connect_lazy_with(follow.list.nodes[index].clone());
    // With `any` the pool never moves: nothing to watch.
    if follow.list.attrs != SessionAttrs::Any {
        tokio::spawn(watch(pool.clone(), follow));
    }
    Ok(pool)
}

/// `options` with the hooks that keep a pool on the node `follow` names.
fn guarded(options: PgPoolOptions, follow: &Arc<Follow>) -> PgPoolOptions {
    let on_connect = follow.clone();
    let options = follow.last_move.drops_older(options);
    options.after_connect(move |conn, _| {
        let follow = on_connect.clone();
        Box::pin(async move {
            if fits(conn, follow.list.attrs).await? {
                return Ok(());
            }
            follow.search.notify_one();
            Err(sqlx::Error::Configuration(
                "the node cannot write any more; searching the node list".into(),
            ))
        })
    })
}

/// Watches the current node; moves the pool when it no longer fits.
async fn watch(pool: PgPool, follow: Arc<Follow>) {
    let mut session: Option<sqlx::PgConnection> = None;
    while !pool.is_closed() {
        tokio::select! {
            biased;
            () = pool.close_event() => return,
            () = follow.search.notified() => session = None,
            () = tokio::time::sleep(WATCH_EVERY) => {}
        }
        let index = follow.index();
        if session.is_none() {
            let connect = follow.list.nodes[index].connect();
            session = tokio::time::timeout(PROBE_TIMEOUT, connect)
                .await
                .ok()
                .and_then(Result::ok);
        }
        let fits_now = match session.as_mut() {
            Some(conn) => matches!(
                tokio::time::timeout(PROBE_TIMEOUT, fits(conn, follow.list.attrs)).await,
                Ok(Ok(true))
            ),
            None => false,
        };
        if fits_now {
            continue;
        }
        session = None;
        if let Some(found) = search(&follow.list).await
            && found != index
        {
            pool.set_connect_options(follow.list.nodes[found].clone());
            follow.moved_to(found);
            tracing::warn!(
                from = index,
                to = found,
                host = follow.list.nodes[found].get_host(),
                port = follow.list.nodes[found].get_port(),
                "the writable PostgreSQL node changed; the pool follows it"
            );
        }
    }
}

/// Why [`connect`] could not make a pool.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The URL cannot be read.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// No node of the list answered as asked.
    #[error("none of the {nodes} PostgreSQL nodes is {attrs:?} (or none answered)")]
    NoNode {
        /// How many the list names.
        nodes: usize,
        /// What a session must find.
        attrs: SessionAttrs,
    },
}

/// A pool the library makes from a service's pool's connect options (the
/// drainer's sessions, the inbox's control pool), kept on the node the
/// service's pool connects to: when that pool moves (see [`connect`]), the
/// derived pool's new sessions go to the new node at its next use, and its
/// idle sessions opened before are closed instead of handed out.
pub(crate) struct Derived {
    source: PgPool,
    pool: PgPool,
    shape: fn(PgConnectOptions) -> PgConnectOptions,
    seen: Mutex<Arc<PgConnectOptions>>,
    last_move: Arc<LastMove>,
}

impl std::fmt::Debug for Derived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Derived")
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl Derived {
    /// `options` over `source`'s connect options shaped by `shape`,
    /// connecting lazily.
    pub(crate) fn new(
        source: &PgPool,
        shape: fn(PgConnectOptions) -> PgConnectOptions,
        options: PgPoolOptions,
    ) -> Self {
        let seen = source.connect_options();
        let last_move = LastMove::now();
        let pool = last_move
            .drops_older(options)
            .connect_lazy_with(shape(seen.as_ref().clone()));
        Self {
            source: source.clone(),
            pool,
            shape,
            seen: Mutex::new(seen),
            last_move,
        }
    }

    /// The pool, on the node the source connects to now.
    pub(crate) fn pool(&self) -> &PgPool {
        let now = self.source.connect_options();
        let mut seen = self.seen.lock().expect("not poisoned");
        if !Arc::ptr_eq(&now, &seen) {
            self.pool
                .set_connect_options((self.shape)(now.as_ref().clone()));
            self.last_move.mark();
            *seen = now;
        }
        &self.pool
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(list: &NodeList) -> Vec<(String, u16)> {
        list.nodes()
            .iter()
            .map(|n| (n.get_host().to_owned(), n.get_port()))
            .collect()
    }

    #[test]
    fn a_node_list_reads_as_libpq_reads_it() {
        let list =
            NodeList::parse("postgres://app:pw@h1:5441,h2,[::1]:5443/orders?sslmode=disable&target_session_attrs=read-write&application_name=svc")
                .unwrap();
        // Each host as sqlx reads the same URL with that host alone.
        let v6: PgConnectOptions = "postgres://app@[::1]:5443/orders".parse().unwrap();
        assert_eq!(
            hosts(&list),
            [
                ("h1".into(), 5441),
                ("h2".into(), 5432),
                (v6.get_host().to_owned(), 5443)
            ]
        );
        assert_eq!(list.attrs(), SessionAttrs::ReadWrite);
        for node in list.nodes() {
            assert_eq!(node.get_database(), Some("orders"));
            assert_eq!(node.get_username(), "app");
            assert_eq!(node.get_application_name(), Some("svc"));
        }
        let one = NodeList::parse("postgresql://localhost/db").unwrap();
        assert_eq!(hosts(&one), [("localhost".into(), 5432)]);
        assert_eq!(one.attrs(), SessionAttrs::Any);
        let primary = NodeList::parse("postgres://a,b/db?target_session_attrs=primary").unwrap();
        assert_eq!(primary.attrs(), SessionAttrs::Primary);
    }

    #[test]
    fn a_bad_node_list_is_refused_naming_the_variable_and_no_password() {
        for url in [
            "mysql://app:pw-secret@h1/db",
            "postgres://app:pw-secret@h1,,h2/db",
            "postgres://app:pw-secret@h1,h2/db?target_session_attrs=standby",
            "postgres://app:pw-secret@h1:notaport/db",
        ] {
            let e = NodeList::parse(url).unwrap_err();
            let shown = e.to_string();
            assert!(shown.starts_with("DATABASE_URL="), "{shown}");
            assert!(!shown.contains("pw-secret"), "{shown}");
        }
    }
}
