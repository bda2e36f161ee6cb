//! Malformed HTTP/2 requests (RFC 9113 §8.1.1): a request whose DATA adds up to more or less
//! than its `content-length` is reset with PROTOCOL_ERROR and never reaches the backend as a
//! complete request, whether the node forwards it or has already answered it (a
//! `direct_response` answers before the body ends; the stream stays the client's until its
//! request does, so the error still comes). Sent by a raw HTTP/2 client that writes the
//! frames itself, so nothing on the client's side checks them first.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;
const NO_ERROR: u32 = 0x0;
const PROTOCOL_ERROR: u32 = 0x1;
/// How long any one step may take before the test fails.
const LIMIT: Duration = Duration::from_secs(10);

/// What the raw HTTP/1.1 backend saw of each request: whether its body was complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    Complete,
    Cut { got: usize, expected: usize },
}

/// An HTTP/1.1 backend that reads each request's head and then as many bytes as its
/// `content-length` says, records whether they all came, and answers 200 only if they did.
struct RecordingBackend {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl RecordingBackend {
    async fn start() -> RecordingBackend {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(read_requests(conn, record.clone()));
            }
        });
        RecordingBackend { addr, seen }
    }

    async fn seen(&self) -> Vec<Seen> {
        self.seen.lock().await.clone()
    }
}

async fn read_requests(mut conn: TcpStream, seen: Arc<Mutex<Vec<Seen>>>) {
    let mut buf = Vec::new();
    loop {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let expected: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse().unwrap());
        buf.drain(..head_end);
        while buf.len() < expected {
            let mut chunk = [0u8; 4096];
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => {
                    let got = buf.len();
                    seen.lock().await.push(Seen::Cut { got, expected });
                    return;
                }
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..expected);
        seen.lock().await.push(Seen::Complete);
        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        if conn.write_all(answer).await.is_err() {
            return;
        }
    }
}

/// One frame as read off the wire.
#[derive(Debug)]
struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

impl Frame {
    fn error_code(&self) -> u32 {
        let at = if self.kind == GOAWAY { 4 } else { 0 };
        u32::from_be_bytes(self.payload[at..at + 4].try_into().unwrap())
    }
}

/// An HTTP/2 client that writes frames byte by byte as the test says (HPACK: every field a
/// literal without indexing, so no table state to keep).
struct RawClient {
    conn: TcpStream,
}

impl RawClient {
    async fn connect(addr: SocketAddr) -> RawClient {
        let mut conn = TcpStream::connect(addr).await.unwrap();
        conn.set_nodelay(true).unwrap();
        conn.write_all(PREFACE).await.unwrap();
        let mut client = RawClient { conn };
        client.send(SETTINGS, 0, 0, &[]).await;
        client
    }

    async fn send(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
        let mut frame = vec![len[1], len[2], len[3], kind, flags];
        frame.extend_from_slice(&stream.to_be_bytes());
        frame.extend_from_slice(payload);
        self.conn.write_all(&frame).await.unwrap();
    }

    /// A POST request's HEADERS on stream 1, its body announced as `content_length` bytes.
    async fn post(&mut self, addr: SocketAddr, path: &str, content_length: usize) {
        let content_length = content_length.to_string();
        let block = header_block(addr, "POST", path, &[("content-length", &content_length)]);
        self.send(HEADERS, END_HEADERS, 1, &block).await;
    }

    /// Sends a GET without a body on stream 3 and reads until its answer ends; returns the
    /// RST_STREAM or GOAWAY code for stream 1 seen before that, if any. The node writes a
    /// stream's reset before the answer of a stream opened after it, so this tells whether
    /// what stream 1 sent before got one (a PING would not: h2 answers PINGs first).
    async fn stream_error_before_another_answer(&mut self, addr: SocketAddr) -> Option<u32> {
        let block = header_block(addr, "GET", "/direct", &[]);
        self.send(HEADERS, END_HEADERS | END_STREAM, 3, &block)
            .await;
        let frame = self
            .until("the answer on stream 3", |f| {
                (f.kind == RST_STREAM && f.stream == 1)
                    || f.kind == GOAWAY
                    || (f.stream == 3 && f.flags & END_STREAM != 0)
            })
            .await;
        (frame.stream != 3).then(|| frame.error_code())
    }

    /// The next frame, or `None` when the node closed the connection.
    async fn next(&mut self) -> Option<Frame> {
        let mut head = [0u8; 9];
        tokio::time::timeout(LIMIT, self.conn.read_exact(&mut head))
            .await
            .expect("the node sent nothing within the limit")
            .ok()?;
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0; len];
        self.conn.read_exact(&mut payload).await.ok()?;
        let stream = u32::from_be_bytes(head[5..9].try_into().unwrap()) & 0x7fff_ffff;
        Some(Frame {
            kind: head[3],
            flags: head[4],
            stream,
            payload,
        })
    }

    /// Reads until the first frame `wanted` accepts (answering the node's SETTINGS), and
    /// returns it; panics if the connection ends first.
    async fn until(&mut self, what: &str, wanted: impl Fn(&Frame) -> bool) -> Frame {
        loop {
            let frame = self
                .next()
                .await
                .unwrap_or_else(|| panic!("the connection closed before {what}"));
            if frame.kind == SETTINGS && frame.flags & ACK == 0 {
                self.send(SETTINGS, ACK, 0, &[]).await;
            }
            if wanted(&frame) {
                return frame;
            }
        }
    }

    /// The stream's error: its RST_STREAM's code, or a GOAWAY's.
    async fn stream_error(&mut self) -> u32 {
        let frame = self
            .until("an RST_STREAM or GOAWAY", |f| {
                (f.kind == RST_STREAM && f.stream == 1) || f.kind == GOAWAY
            })
            .await;
        frame.error_code()
    }
}

/// A request's header block: every field a literal without indexing.
fn header_block(addr: SocketAddr, method: &str, path: &str, extra: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    let authority = addr.to_string();
    let fields = [
        (":method", method),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority.as_str()),
    ];
    for (name, value) in fields.iter().chain(extra) {
        block.push(0x00);
        for s in [name, value] {
            block.push(u8::try_from(s.len()).unwrap());
            block.extend_from_slice(s.as_bytes());
        }
    }
    block
}

fn node(backend: SocketAddr) -> (TestNode, SocketAddr) {
    let (admin, listen) = (free_addr(), free_addr());
    let node = TestNode::start(&format!(
        r#"
admin: {admin}
workers: 1
listeners:
  - name: web
    address: {listen}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: /direct }} }}
        direct_response: {{ status: 200, body: "answered" }}
      - match: {{ path: {{ prefix: / }} }}
        cluster: app
clusters:
  - name: app
    endpoints: [ {backend} ]
"#
    ));
    (node, listen)
}

/// Sends a request to the backend with `content-length: 10` and `sent` bytes of DATA, and
/// checks the stream is reset with PROTOCOL_ERROR and the backend saw no complete request.
async fn forwarded_body_of(sent: usize) {
    let backend = RecordingBackend::start().await;
    let (_node, listen) = node(backend.addr);
    let mut client = RawClient::connect(listen).await;
    client.post(listen, "/upload", 10).await;
    client.send(DATA, END_STREAM, 1, &vec![b'x'; sent]).await;
    assert_eq!(
        client.stream_error().await,
        PROTOCOL_ERROR,
        "content-length 10 with {sent} bytes of DATA is malformed"
    );
    // Whatever reached the backend ends now, cut short (or nothing did: the node may have
    // had the reset before it had an upstream connection).
    let recorded = &backend;
    let ended = eventually(Duration::from_secs(2), || async move {
        !recorded.seen().await.is_empty()
    })
    .await;
    let seen = backend.seen().await;
    assert!(
        !seen.contains(&Seen::Complete),
        "the backend got a complete request from a malformed one: {seen:?}"
    );
    if ended {
        assert_eq!(
            seen,
            [Seen::Cut {
                got: 0,
                expected: 10
            }]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn less_data_than_content_length_is_reset_and_never_forwarded_complete() {
    forwarded_body_of(5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_data_than_content_length_is_reset_and_never_forwarded_complete() {
    forwarded_body_of(15).await;
}

/// Sends a request answered at once by a `direct_response`, reads the whole answer, then
/// sends `sent` bytes of DATA that end the request; returns the RST_STREAM or GOAWAY code
/// they got, if any.
async fn body_after_the_answer(sent: usize) -> Option<u32> {
    let backend = RecordingBackend::start().await;
    let (_node, listen) = node(backend.addr);
    let mut client = RawClient::connect(listen).await;
    client.post(listen, "/direct", 10).await;
    // The answer comes before the body: its last frame ends the stream on the node's side.
    let end = client
        .until("the answer", |f| f.stream == 1 && f.kind != RST_STREAM)
        .await;
    let end = if end.flags & END_STREAM == 0 {
        client
            .until("the answer's end", |f| {
                f.stream == 1 && (f.kind == RST_STREAM || f.flags & END_STREAM != 0)
            })
            .await
    } else {
        end
    };
    assert_ne!(end.kind, RST_STREAM, "the node reset the stream: {end:?}");
    client.send(DATA, END_STREAM, 1, &vec![b'x'; sent]).await;
    let error = client.stream_error_before_another_answer(listen).await;
    assert!(
        backend.seen().await.is_empty(),
        "nothing goes to the backend"
    );
    error
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn less_data_than_content_length_after_an_early_answer_is_still_a_protocol_error() {
    assert_eq!(body_after_the_answer(5).await, Some(PROTOCOL_ERROR));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_data_than_content_length_after_an_early_answer_is_still_a_protocol_error() {
    assert_eq!(body_after_the_answer(15).await, Some(PROTOCOL_ERROR));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_ends_well_after_an_early_answer_is_not_reset() {
    assert_eq!(body_after_the_answer(10).await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_past_one_window_after_an_early_answer_is_stopped_without_error() {
    let backend = RecordingBackend::start().await;
    let (_node, listen) = node(backend.addr);
    let mut client = RawClient::connect(listen).await;
    // More than the default stream window (64 KiB): the node discards one window's worth
    // after its answer, then tells the client to stop.
    client.post(listen, "/direct", 1 << 20).await;
    client
        .until("the answer's end", |f| {
            f.stream == 1 && (f.kind == RST_STREAM || f.flags & END_STREAM != 0)
        })
        .await;
    let piece = vec![b'x'; 16 * 1024];
    let mut sent = 0;
    while sent < 64 * 1024 {
        client.send(DATA, 0, 1, &piece).await;
        sent += piece.len();
    }
    // The node opens the window as it discards: one more piece goes past the bound.
    client
        .until("a WINDOW_UPDATE", |f| {
            f.kind == WINDOW_UPDATE && f.stream == 1
        })
        .await;
    client.send(DATA, 0, 1, &piece).await;
    assert_eq!(client.stream_error().await, NO_ERROR);
}
