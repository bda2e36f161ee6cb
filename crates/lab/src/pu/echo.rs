//! A tiny line server that tells the caller what it saw: its name, the peer address and the local
//! address of the connection. The demo, the tests and the benchmark use it as the "app" on a PU.
//! With `reply_only` it echoes bytes back unchanged (for round-trip timing).

use std::io::{self, BufRead as _, BufReader, Read as _, Write as _};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd as _;
use std::thread::JoinHandle;

pub struct EchoServer {
    listener: TcpListener,
    accept: Option<JoinHandle<()>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Read one line, answer `<name> saw peer=<addr> local=<addr> line=<line>` and close.
    Describe,
    /// Echo every byte back until the peer closes.
    Echo,
}

impl EchoServer {
    /// Serves `listener`; its threads inherit the calling thread's PU.
    pub fn start(listener: TcpListener, name: &str, mode: Mode) -> io::Result<EchoServer> {
        let l = listener.try_clone()?;
        let name = name.to_string();
        let accept = std::thread::Builder::new()
            .name("pu-echo".into())
            .spawn(move || {
                while let Ok((stream, _)) = l.accept() {
                    let name = name.clone();
                    let _ = std::thread::Builder::new()
                        .name("pu-echo-conn".into())
                        .spawn(move || {
                            let _ = serve(stream, &name, mode);
                        });
                }
            })?;
        Ok(EchoServer {
            listener,
            accept: Some(accept),
        })
    }
}

fn serve(stream: TcpStream, name: &str, mode: Mode) -> io::Result<()> {
    let peer = stream.peer_addr()?;
    let local = stream.local_addr()?;
    match mode {
        Mode::Describe => {
            let mut line = String::new();
            BufReader::new(stream.try_clone()?)
                .take(4096)
                .read_line(&mut line)?;
            let mut s = stream;
            writeln!(
                s,
                "{name} saw peer={peer} local={local} line={}",
                line.trim()
            )?;
            s.shutdown(Shutdown::Write)
        }
        Mode::Echo => {
            let mut r = stream.try_clone()?;
            let mut w = stream;
            io::copy(&mut r, &mut w)?;
            w.shutdown(Shutdown::Write)
        }
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        // SAFETY: the descriptor is owned by self.listener and still open.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

/// Connects to `addr`, sends `line`, returns the one-line answer (2 s limits).
pub fn ask(addr: std::net::SocketAddr, line: &str) -> io::Result<(String, std::net::SocketAddr)> {
    let timeout = std::time::Duration::from_secs(2);
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    let local = s.local_addr()?;
    writeln!(s, "{line}")?;
    let mut answer = String::new();
    BufReader::new(s).take(4096).read_line(&mut answer)?;
    Ok((answer.trim().to_string(), local))
}
