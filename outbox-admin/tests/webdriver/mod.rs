//! A small WebDriver client for the console's browser test: chromedriver
//! started on a free loopback port, Debian's Chromium headless, and the
//! handful of commands the test needs, over plain HTTP/1.1 (no client
//! library: the W3C protocol is JSON over a few routes).

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// A headless Chromium session.
pub struct Browser {
    driver: Child,
    port: u16,
    session: String,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn chromium() -> &'static str {
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("Chromium is not installed: apt-get install chromium chromium-driver (.ci/run installs them)")
}

impl Browser {
    /// Starts chromedriver and a headless browser session.
    pub async fn start() -> Self {
        let port = free_port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver is not installed: apt-get install chromium chromium-driver (.ci/run installs them)");
        let mut b = Self {
            driver,
            port,
            session: String::new(),
        };
        for _ in 0..100 {
            if matches!(b.call("GET", "/status", None).await, Ok(v) if v["value"]["ready"] == true)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let caps = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium(),
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--window-size=1280,860"]
            }
        }}});
        let v = b
            .call("POST", "/session", Some(caps))
            .await
            .expect("a browser session");
        b.session = v["value"]["sessionId"]
            .as_str()
            .expect("a session id")
            .to_owned();
        b
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.port,
            body.len()
        );
        let exchange = async {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .map_err(|e| e.to_string())?;
            s.write_all(request.as_bytes())
                .await
                .map_err(|e| e.to_string())?;
            read_answer(&mut s).await
        };
        let body = tokio::time::timeout(CALL_TIMEOUT, exchange)
            .await
            .map_err(|_| format!("{method} {path}: no answer in {CALL_TIMEOUT:?}"))??;
        let v: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        if v["value"]["error"].is_string() {
            return Err(format!("{method} {path}: {}", v["value"]));
        }
        Ok(v)
    }

    async fn cmd(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let path = format!("/session/{}{path}", self.session);
        match self.call(method, &path, body).await {
            Ok(v) => v["value"].clone(),
            Err(e) => panic!("webdriver: {e}"),
        }
    }

    async fn find(&self, css: &str) -> String {
        let v = self
            .cmd(
                "POST",
                "/element",
                Some(json!({ "using": "css selector", "value": css })),
            )
            .await;
        v[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element {css}"))
            .to_owned()
    }

    /// Opens `url`.
    pub async fn go(&self, url: &str) {
        self.cmd("POST", "/url", Some(json!({ "url": url }))).await;
    }

    /// The page's title.
    pub async fn title(&self) -> String {
        self.cmd("GET", "/title", None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// The text of `css` once it contains `needle` (a click's navigation
    /// may still be under way), polled for at most ten seconds; the last
    /// text seen otherwise.
    pub async fn text_with(&self, css: &str, needle: &str) -> String {
        let mut last = String::new();
        for _ in 0..100 {
            let path = format!("/session/{}/element", self.session);
            let found = self
                .call(
                    "POST",
                    &path,
                    Some(json!({ "using": "css selector", "value": css })),
                )
                .await;
            if let Ok(v) = found
                && let Some(e) = v["value"][ELEMENT].as_str()
                && let Ok(t) = self.call("GET", &format!("{path}/{e}/text"), None).await
            {
                last = t["value"].as_str().unwrap_or_default().to_owned();
                if last.contains(needle) {
                    return last;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        last
    }

    /// How many elements match `css`.
    pub async fn count(&self, css: &str) -> usize {
        let v = self
            .cmd(
                "POST",
                "/elements",
                Some(json!({ "using": "css selector", "value": css })),
            )
            .await;
        v.as_array().map_or(0, Vec::len)
    }

    /// Clicks the first element matching `css`.
    pub async fn click(&self, css: &str) {
        let e = self.find(css).await;
        self.cmd("POST", &format!("/element/{e}/click"), Some(json!({})))
            .await;
    }

    /// Types `text` into the first element matching `css`.
    pub async fn type_into(&self, css: &str, text: &str) {
        let e = self.find(css).await;
        self.cmd(
            "POST",
            &format!("/element/{e}/value"),
            Some(json!({ "text": text })),
        )
        .await;
    }

    /// `document.cookie`: the cookies a script on the page can read.
    pub async fn cookies_visible_to_script(&self) -> String {
        let v = self
            .cmd(
                "POST",
                "/execute/sync",
                Some(json!({ "script": "return document.cookie", "args": [] })),
            )
            .await;
        v.as_str().unwrap_or_default().to_owned()
    }

    /// A PNG of the window, written to `path` (its directory made if
    /// missing: a build with its target directory elsewhere has none).
    pub async fn screenshot(&self, path: &std::path::Path) {
        use base64_png::decode;
        let v = self.cmd("GET", "/screenshot", None).await;
        let png = decode(v.as_str().unwrap_or_default());
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::fs::write(path, png).unwrap();
    }

    /// Ends the session.
    pub async fn quit(&self) {
        self.cmd("DELETE", "", None).await;
    }
}

/// Reads one HTTP answer's body: by its `Content-Length`, or chunked to
/// the last chunk, or to the end of the stream (the driver may keep the
/// connection open whatever the request asked).
async fn read_answer(s: &mut tokio::net::TcpStream) -> Result<String, String> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = s.read(&mut buf).await.map_err(|e| e.to_string())?;
        raw.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&raw).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let head = head.to_ascii_lowercase();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok());
            match length {
                Some(len) if body.len() >= len => return Ok(body[..len].to_owned()),
                None if head.contains("transfer-encoding: chunked")
                    && body.ends_with("0\r\n\r\n") =>
                {
                    return Ok(dechunk(body));
                }
                _ => {}
            }
        }
        if n == 0 {
            return match text.split_once("\r\n\r\n") {
                Some((_, body)) => Ok(body.to_owned()),
                None => Err("the driver closed the connection without an answer".into()),
            };
        }
    }
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}

/// Standard base64, decoded (a screenshot's PNG; no dependency for it).
mod base64_png {
    pub fn decode(text: &str) -> Vec<u8> {
        let value = |c: u8| match c {
            b'A'..=b'Z' => Some(c - b'A'),
            b'a'..=b'z' => Some(c - b'a' + 26),
            b'0'..=b'9' => Some(c - b'0' + 52),
            b'+' => Some(62),
            b'/' => Some(63),
            _ => None,
        };
        let digits: Vec<u8> = text.bytes().filter_map(value).collect();
        let mut out = Vec::with_capacity(digits.len() * 3 / 4);
        for chunk in digits.chunks(4) {
            let n = chunk
                .iter()
                .enumerate()
                .fold(0u32, |acc, (i, d)| acc | (u32::from(*d) << (18 - 6 * i)));
            let bytes = n.to_be_bytes();
            out.extend_from_slice(&bytes[1..chunk.len()]);
        }
        out
    }
}
