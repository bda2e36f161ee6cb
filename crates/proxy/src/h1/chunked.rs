//! A streaming parser for the chunked transfer coding (RFC 9112 §7.1).
//!
//! The proxy forwards a chunked body without re-encoding it, so the parser's main job is to
//! find where the body ends and to refuse malformed framing (a bad chunk size is a request
//! smuggling shape: the message must be rejected, never guessed at). It can also report the
//! data bytes, for the few cases where the body has to be decoded (an HTTP/1.0 client).
//! The trailer section is not passed through as it came: the parser keeps it
//! ([`ChunkedParser::trailer_section`]) so that the relay sends on only the fields that may
//! be trailers (`crate::trailers`).
//!
//! It is strict where leniency would let two parsers disagree about the message end:
//! chunk-size lines and chunk data end with CRLF, never a bare LF; sizes are hex digits only,
//! at most 15 of them; only spaces or tabs may stand between the size and a `;` extension.

use std::ops::Range;

/// Longest chunk-size line, extensions included, and longest trailer section.
const MAX_SIZE_LINE: usize = 4096;
const MAX_TRAILERS: usize = 64 * 1024;
/// 15 hex digits: sizes stay far below u64::MAX, so arithmetic on them never overflows.
const MAX_SIZE_DIGITS: usize = 15;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkError {
    BadSize,
    SizeLineTooLong,
    MissingCrlf,
    TrailersTooLong,
}

impl ChunkError {
    pub fn describe(self) -> &'static str {
        match self {
            ChunkError::BadSize => "bad chunk size",
            ChunkError::SizeLineTooLong => "chunk-size line too long",
            ChunkError::MissingCrlf => "chunk not terminated by CRLF",
            ChunkError::TrailersTooLong => "trailer section too long",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Reading hex digits of a chunk size.
    Size,
    /// After the digits: optional whitespace, then `;ext` or CR.
    SizeTail,
    /// Inside a chunk extension, up to CR.
    Extension,
    /// Saw CR after the size line; LF must follow.
    SizeLf,
    /// Inside chunk data.
    Data,
    /// After chunk data: CR, then LF.
    DataCr,
    DataLf,
    /// At the start of a trailer line (or of the final empty line).
    TrailerStart,
    /// Inside a trailer field line, up to CR.
    TrailerLine,
    /// Saw CR at the end of a trailer line.
    TrailerLf,
    /// Saw CR of the final empty line.
    EndLf,
    Done,
}

/// How far one call got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Input bytes that belong to the body (all of them unless the body ended).
    pub consumed: usize,
    /// The first `framed` of them are chunks (sizes, data, the last chunk's line), to be
    /// passed on as they came; the rest are trailer section, kept by the parser.
    pub framed: usize,
    /// The body's last byte was among them.
    pub done: bool,
}

#[derive(Debug, Clone)]
pub struct ChunkedParser {
    state: State,
    size: u64,
    digits: usize,
    line: usize,
    /// The trailer section read so far (at most MAX_TRAILERS bytes), final CRLF included.
    trailers: Vec<u8>,
}

impl Default for ChunkedParser {
    fn default() -> Self {
        Self::new()
    }
}

impl ChunkedParser {
    pub fn new() -> Self {
        ChunkedParser {
            state: State::Size,
            size: 0,
            digits: 0,
            line: 0,
            trailers: Vec::new(),
        }
    }

    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// The trailer section as it came (every byte after the last chunk's line, the final
    /// empty line included); whole once the body is done.
    pub fn trailer_section(&self) -> &[u8] {
        &self.trailers
    }

    fn in_trailers(&self) -> bool {
        matches!(
            self.state,
            State::TrailerStart | State::TrailerLine | State::TrailerLf | State::EndLf
        )
    }

    /// Parses as much of `input` as belongs to the body. `on_data` receives the ranges of
    /// `input` that are chunk data, in order. Once the body is done, the rest of `input`
    /// (a pipelined next message) is left alone.
    pub fn advance(
        &mut self,
        input: &[u8],
        mut on_data: impl FnMut(Range<usize>),
    ) -> Result<Progress, ChunkError> {
        let mut i = 0;
        // Where the trailer section starts in this input, once it has.
        let mut framed = if self.in_trailers() { Some(0) } else { None };
        while i < input.len() {
            let b = input[i];
            if framed.is_none() && self.in_trailers() {
                framed = Some(i);
            }
            match self.state {
                State::Size => match hex(b) {
                    Some(d) if self.digits < MAX_SIZE_DIGITS => {
                        self.size = self.size << 4 | u64::from(d);
                        self.digits += 1;
                    }
                    Some(_) => return Err(ChunkError::BadSize),
                    None if self.digits == 0 => return Err(ChunkError::BadSize),
                    None => {
                        self.state = State::SizeTail;
                        continue;
                    }
                },
                State::SizeTail => match b {
                    b' ' | b'\t' => {}
                    b';' => self.state = State::Extension,
                    b'\r' => self.state = State::SizeLf,
                    _ => return Err(ChunkError::BadSize),
                },
                State::Extension => match b {
                    b'\r' => self.state = State::SizeLf,
                    // Extensions are tokens and quoted strings: no control bytes.
                    b'\n' | 0 => return Err(ChunkError::BadSize),
                    _ => {}
                },
                State::SizeLf => {
                    if b != b'\n' {
                        return Err(ChunkError::MissingCrlf);
                    }
                    self.line = 0;
                    self.digits = 0;
                    self.state = if self.size == 0 {
                        State::TrailerStart
                    } else {
                        State::Data
                    };
                }
                State::Data => {
                    let available = (input.len() - i) as u64;
                    let take = available.min(self.size) as usize;
                    on_data(i..i + take);
                    self.size -= take as u64;
                    i += take;
                    if self.size == 0 {
                        self.state = State::DataCr;
                    }
                    continue;
                }
                State::DataCr => {
                    if b != b'\r' {
                        return Err(ChunkError::MissingCrlf);
                    }
                    self.state = State::DataLf;
                }
                State::DataLf => {
                    if b != b'\n' {
                        return Err(ChunkError::MissingCrlf);
                    }
                    self.state = State::Size;
                }
                State::TrailerStart => match b {
                    b'\r' => self.state = State::EndLf,
                    b'\n' => return Err(ChunkError::MissingCrlf),
                    _ => self.state = State::TrailerLine,
                },
                State::TrailerLine => match b {
                    b'\r' => self.state = State::TrailerLf,
                    b'\n' => return Err(ChunkError::MissingCrlf),
                    _ => {}
                },
                State::TrailerLf => {
                    if b != b'\n' {
                        return Err(ChunkError::MissingCrlf);
                    }
                    self.state = State::TrailerStart;
                }
                State::EndLf => {
                    if b != b'\n' {
                        return Err(ChunkError::MissingCrlf);
                    }
                    self.state = State::Done;
                    self.trailers.push(b);
                    return Ok(Progress {
                        consumed: i + 1,
                        framed: framed.unwrap_or(i),
                        done: true,
                    });
                }
                State::Done => {
                    return Ok(Progress {
                        consumed: i,
                        framed: framed.unwrap_or(i),
                        done: true,
                    })
                }
            }
            match self.state {
                State::Size | State::SizeTail | State::Extension | State::SizeLf => {
                    self.line += 1;
                    if self.line > MAX_SIZE_LINE {
                        return Err(ChunkError::SizeLineTooLong);
                    }
                }
                // The byte just read belongs to the trailer section.
                State::TrailerStart | State::TrailerLine | State::TrailerLf | State::EndLf
                    if framed.is_some() =>
                {
                    if self.trailers.len() >= MAX_TRAILERS {
                        return Err(ChunkError::TrailersTooLong);
                    }
                    self.trailers.push(b);
                }
                _ => {}
            }
            i += 1;
        }
        Ok(Progress {
            consumed: input.len(),
            framed: framed.unwrap_or(input.len()),
            done: self.state == State::Done,
        })
    }
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Writes the chunk header for `len` data bytes (`len` > 0) into `out`.
pub fn chunk_header(out: &mut Vec<u8>, len: usize) {
    use std::io::Write;
    let _ = write!(out, "{len:x}\r\n");
}

/// The end of a chunked body without trailers.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `input` in pieces of `step` bytes; returns the decoded data and where the body ended.
    fn decode(input: &[u8], step: usize) -> Result<(Vec<u8>, usize), ChunkError> {
        let mut p = ChunkedParser::new();
        let mut data = Vec::new();
        let mut offset = 0;
        while offset < input.len() {
            let piece = &input[offset..(offset + step).min(input.len())];
            let progress = p.advance(piece, |r| data.extend_from_slice(&piece[r]))?;
            offset += progress.consumed;
            if progress.done {
                return Ok((data, offset));
            }
        }
        Err(ChunkError::MissingCrlf)
    }

    #[test]
    fn decodes_in_any_split() {
        let body = b"5\r\nhello\r\n6;name=val\r\n world\r\n0\r\nx-t: 1\r\n\r\nNEXT";
        for step in 1..body.len() {
            let (data, end) = decode(body, step).expect("valid body");
            assert_eq!(data, b"hello world", "step {step}");
            assert_eq!(&body[end..], b"NEXT", "step {step}");
        }
    }

    #[test]
    fn refuses_smuggling_shapes() {
        for bad in [
            &b"g\r\n"[..],
            b"\r\n",
            b"-1\r\n",
            b"5 5\r\n",
            b"5\nhello\r\n0\r\n\r\n",
            b"5\r\nhelloXX0\r\n\r\n",
            b"0\r\n\n",
            b"1234567890abcdef0\r\n",
            b"0x5\r\n",
        ] {
            assert!(
                decode(bad, 1).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn whitespace_before_extension_is_allowed() {
        let (data, _) = decode(b"3 \t;ext\r\nabc\r\n0\r\n\r\n", 3).expect("valid");
        assert_eq!(data, b"abc");
    }

    #[test]
    fn huge_size_lines_are_cut_off() {
        let mut line = b"1;".to_vec();
        line.resize(MAX_SIZE_LINE + 10, b'a');
        assert_eq!(decode(&line, 64), Err(ChunkError::SizeLineTooLong));
    }
}
