//! The crate's one error type. Every message says what is wrong and what to do about it.

/// Everything that can go wrong in QNP: bad IDL or rule files, malformed wire data, transport failures.
#[derive(Debug, thiserror::Error)]
pub enum QnpError {
    /// The IDL file is malformed.
    #[error("{file}:{line}:{col}: {msg}")]
    Idl {
        file: String,
        line: usize,
        col: usize,
        msg: String,
    },
    /// The rule file is malformed.
    #[error("{file}:{line}: {msg}")]
    Rules {
        file: String,
        line: usize,
        msg: String,
    },
    /// A TLV byte stream could not be decoded.
    #[error("malformed TLV at byte {offset}: {msg}; the sender and receiver probably disagree on the IDL, recompile both from the same file")]
    Tlv { offset: usize, msg: String },
    /// A value does not fit into the TLV length field.
    #[error("field {field} is {len} bytes but a TLV value holds at most 65535 bytes; split the value or use several fields")]
    ValueTooLong { field: u8, len: usize },
    /// A QNP packet is malformed.
    #[error(
        "malformed QNP packet: {0}; check that the peer speaks QNP (header layout of docs/qnp.md)"
    )]
    Packet(String),
    /// A transport setting makes no working endpoint.
    #[error("bad QNP setting: {0}")]
    Config(String),
    /// A request cannot be segmented under the configured limits.
    #[error("{0}")]
    TooLarge(String),
    /// The compiled rules do not fit the Matcher's tables.
    #[error("{0}")]
    TableFull(String),
    /// A table image file is malformed.
    #[error("bad table image: {0}; recompile it with `flatmesh qnp rules compile`")]
    Image(String),
    /// The peer did not acknowledge a request.
    #[error("request {req_id} to {peer} was not acknowledged after {attempts} attempts; check that a QNP receiver listens there and that nothing drops UDP between the hosts")]
    Timeout {
        req_id: u32,
        peer: std::net::SocketAddr,
        attempts: u32,
    },
    /// The kernel dispatcher could not be loaded or configured.
    #[error("kernel dispatcher: {0}; it needs root (CAP_BPF and CAP_NET_ADMIN) and a kernel with sk_reuseport BPF (4.19+); use a software dispatch mode otherwise")]
    Kernel(String),
    /// The endpoint was shut down.
    #[error("the QNP endpoint is closed; create a new one")]
    Closed,
    /// A socket operation failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl QnpError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        QnpError::Io {
            what: what.into(),
            source,
        }
    }
}
