//! The console's HTTP side: the page at `GET /ui` (HTML, JS and CSS embedded in the binary; no
//! CDN, it works offline), the snapshot at `GET /ui/state`, and the same snapshot once a second
//! as server-sent events at `GET /ui/events`.
//!
//! One snapshot is built per second whatever the number of viewers, and every viewer gets that
//! same text. At most [`MAX_CONNECTIONS`] connections at once (event streams included); a
//! request head must arrive within [`READ_TIMEOUT`] and fit in `MAX_HEAD` bytes; a viewer that
//! does not take an event within [`WRITE_TIMEOUT`] is dropped.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::Console;
use crate::serve::metrics::read_head;

/// Connections served at once; more wait in the accept queue.
pub const MAX_CONNECTIONS: usize = 32;
/// A request head not sent by then drops the connection.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// A viewer that does not take an event within this time is dropped.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the snapshot is rebuilt and sent.
pub const PERIOD: Duration = Duration::from_secs(1);

const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const APP_CSS: &str = include_str!("assets/app.css");

/// Serves the console on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, console: Console) {
    let first = Arc::new(snapshot_json(&console));
    let (tx, rx) = watch::channel(first);
    let ticker = tokio::spawn(async move {
        let mut tick = tokio::time::interval(PERIOD);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if tx.send(Arc::new(snapshot_json(&console))).is_err() {
                return;
            }
        }
    });
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            break;
        };
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "console: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let rx = rx.clone();
        tokio::spawn(async move {
            let _slot = slot;
            answer(stream, rx).await;
        });
    }
    ticker.abort();
}

fn snapshot_json(console: &Console) -> String {
    serde_json::to_string(&console.snapshot()).unwrap_or_else(|e| {
        // Serializing plain strings and numbers cannot fail; say so if it ever does.
        format!("{{\"error\":\"cannot serialize the snapshot: {e}\"}}")
    })
}

async fn answer(mut stream: TcpStream, rx: watch::Receiver<Arc<String>>) {
    let head = match tokio::time::timeout(READ_TIMEOUT, read_head(&mut stream)).await {
        Ok(Some(head)) => head,
        _ => return,
    };
    let mut words = head.split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    if method != "GET" {
        let _ = respond(
            &mut stream,
            "405 Method Not Allowed",
            "text/plain",
            "only GET is served\n",
        )
        .await;
        return;
    }
    let (status, kind, body): (&str, &str, &str) = match path {
        "/ui" | "/ui/" => ("200 OK", "text/html; charset=utf-8", INDEX_HTML),
        "/ui/app.js" => ("200 OK", "text/javascript; charset=utf-8", APP_JS),
        "/ui/app.css" => ("200 OK", "text/css; charset=utf-8", APP_CSS),
        "/ui/state" => {
            let json = rx.borrow().clone();
            let _ = respond(&mut stream, "200 OK", "application/json", &json).await;
            return;
        }
        "/ui/events" => {
            events(stream, rx).await;
            return;
        }
        _ => (
            "404 Not Found",
            "text/plain",
            "the console is at /ui (its data at /ui/state and /ui/events)\n",
        ),
    };
    let _ = respond(&mut stream, status, kind, body).await;
}

async fn respond(
    stream: &mut TcpStream,
    status: &str,
    kind: &str,
    body: &str,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {kind}\r\ncontent-length: {}\r\ncache-control: no-store\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    };
    tokio::time::timeout(WRITE_TIMEOUT, write)
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
}

/// The event stream: the current snapshot, then every new one, until the viewer leaves.
async fn events(mut stream: TcpStream, mut rx: watch::Receiver<Arc<String>>) {
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-store\r\nconnection: close\r\n\r\n";
    let mut next = Some(rx.borrow_and_update().clone());
    let mut first = true;
    loop {
        let Some(json) = next.take() else {
            return;
        };
        // The snapshot is one line of JSON: one `data:` line is the whole event.
        let event = format!("{}data: {json}\n\n", if first { head } else { "" });
        first = false;
        match tokio::time::timeout(WRITE_TIMEOUT, stream.write_all(event.as_bytes())).await {
            Ok(Ok(())) => {}
            _ => return,
        }
        if rx.changed().await.is_err() {
            return;
        }
        next = Some(rx.borrow_and_update().clone());
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, BufReader};

    async fn get(at: std::net::SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(at).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_the_page_the_state_and_a_stream_of_snapshots() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = listener.local_addr().unwrap();
        let console = Console::default();
        console.set_model(["a/b".to_string()], Default::default());
        let server = tokio::spawn(serve(listener, console.clone()));

        let page = get(at, "/ui").await;
        assert!(page.starts_with("HTTP/1.1 200"), "{page}");
        assert!(page.contains("id=\"service-graph\""), "{page}");
        assert!(
            !page.contains("http://") && !page.contains("https://"),
            "no external assets"
        );
        assert!(get(at, "/ui/app.js").await.contains("EventSource"));
        let state = get(at, "/ui/state").await;
        let body = state.split("\r\n\r\n").nth(1).unwrap();
        let json: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(json["services"][0]["name"], "a/b");
        assert!(get(at, "/nope").await.starts_with("HTTP/1.1 404"));

        let mut s = TcpStream::connect(at).await.unwrap();
        s.write_all(b"GET /ui/events HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut lines = BufReader::new(s).lines();
        let mut events = 0;
        while events < 2 {
            let line = lines.next_line().await.unwrap().unwrap();
            if let Some(data) = line.strip_prefix("data: ") {
                let snap: serde_json::Value = serde_json::from_str(data).unwrap();
                assert!(snap["generated_unix_ms"].as_u64().unwrap() > 0);
                events += 1;
            }
        }
        server.abort();
    }
}
