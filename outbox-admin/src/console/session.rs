//! Console sessions: a signed-in operator holds an opaque session id in an
//! `HttpOnly`, `SameSite=Strict` cookie (the bearer token never reaches a
//! page or a URL), and every form carries the session's CSRF token.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, header};

/// The session cookie's name.
pub const COOKIE: &str = "outbox_console";
/// The login form's own cookie (its CSRF token before a session exists).
pub const LOGIN_COOKIE: &str = "outbox_console_login";
/// How long a session lasts.
pub const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);
/// Most sessions held at once; the oldest goes first beyond it.
pub const SESSIONS_MAX: usize = 1024;

/// A random secret: 244 bits from the operating system's generator.
pub fn secret() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// Equal in constant time (for equal lengths).
pub fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// One signed-in operator.
#[derive(Debug, Clone)]
pub struct Session {
    /// The token every form of this session carries.
    pub csrf: String,
    started: Instant,
}

/// The sessions of one console.
#[derive(Debug, Clone, Default)]
pub struct Sessions {
    inner: Arc<Mutex<BTreeMap<String, Session>>>,
}

impl Sessions {
    /// A new session; returns its id.
    pub fn open(&self) -> String {
        let id = secret();
        let mut map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        map.retain(|_, s| now.duration_since(s.started) < SESSION_TTL);
        while map.len() >= SESSIONS_MAX {
            let oldest = map
                .iter()
                .min_by_key(|(_, s)| s.started)
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => map.remove(&k),
                None => break,
            };
        }
        map.insert(
            id.clone(),
            Session {
                csrf: secret(),
                started: now,
            },
        );
        id
    }

    /// The live session the request's cookie names.
    pub fn of(&self, headers: &HeaderMap) -> Option<Session> {
        let id = cookie(headers, COOKIE)?;
        let map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&id)
            .filter(|s| s.started.elapsed() < SESSION_TTL)
            .cloned()
    }

    /// Ends the request's session.
    pub fn close(&self, headers: &HeaderMap) {
        if let Some(id) = cookie(headers, COOKIE) {
            let mut map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            map.remove(&id);
        }
    }
}

/// The value of cookie `name` in the request.
pub fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
}

/// A `Set-Cookie` value for the console's path; `secure` adds `Secure`.
pub fn set_cookie(name: &str, value: &str, max_age: Duration, secure: bool) -> String {
    format!(
        "{name}={value}; Path=/admin; HttpOnly; SameSite=Strict; Max-Age={}{}",
        max_age.as_secs(),
        if secure { "; Secure" } else { "" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn a_session_is_found_by_its_cookie_and_closed() {
        let sessions = Sessions::default();
        let id = sessions.open();
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_str(&format!("other=1; {COOKIE}={id}")).unwrap(),
        );
        let s = sessions.of(&h).expect("open");
        assert_eq!(s.csrf.len(), 64);
        assert_ne!(s.csrf, id);
        sessions.close(&h);
        assert!(sessions.of(&h).is_none());
        assert!(same("abc", "abc") && !same("abc", "abd") && !same("abc", "ab"));
    }

    #[test]
    fn sessions_are_bounded() {
        let sessions = Sessions::default();
        for _ in 0..SESSIONS_MAX + 10 {
            sessions.open();
        }
        assert_eq!(sessions.inner.lock().unwrap().len(), SESSIONS_MAX);
    }
}
