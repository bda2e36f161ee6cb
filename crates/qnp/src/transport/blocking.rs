//! The blocking form of the QNP API, for callers without an async runtime.

use crate::transport::{Endpoint, OutReq, QnpConfig, Request, Response, RxStats};
use crate::QnpError;
use std::net::SocketAddr;

/// A UDP QNP endpoint whose calls block. It owns a one-thread tokio runtime that runs the
/// receive task, so requests keep arriving between calls.
pub struct BlockingEndpoint {
    // Field order matters: the endpoint (and its task) must drop before the runtime.
    ep: Endpoint<tokio::net::UdpSocket>,
    rt: tokio::runtime::Runtime,
}

impl BlockingEndpoint {
    /// Binds a UDP socket at `addr`.
    pub fn bind(addr: SocketAddr, cfg: QnpConfig) -> Result<Self, QnpError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| QnpError::io("starting the QNP runtime", e))?;
        let sock = rt
            .block_on(tokio::net::UdpSocket::bind(addr))
            .map_err(|e| QnpError::io(format!("binding UDP {addr} (is the port in use?)"), e))?;
        let ep = {
            let _enter = rt.enter();
            Endpoint::new(sock, cfg)?
        };
        Ok(BlockingEndpoint { ep, rt })
    }

    /// See [`Endpoint::send_req`].
    pub fn send_req(&self, peer: SocketAddr, req: &OutReq) -> Result<Response, QnpError> {
        self.rt.block_on(self.ep.send_req(peer, req))
    }

    /// See [`Endpoint::recv_req`].
    pub fn recv_req(&self) -> Result<Request, QnpError> {
        self.rt.block_on(self.ep.recv_req())
    }

    /// See [`Endpoint::respond`].
    pub fn respond(&self, to: &Request, resp: &OutReq) -> Result<(), QnpError> {
        self.rt.block_on(self.ep.respond(to, resp))
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, QnpError> {
        self.ep.local_addr()
    }

    /// Receiver counters.
    pub fn stats(&self) -> RxStats {
        self.ep.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn blocking_request_response_over_udp() {
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        let server = BlockingEndpoint::bind(any, QnpConfig::default()).unwrap();
        let client = BlockingEndpoint::bind(any, QnpConfig::default()).unwrap();
        let to = server.local_addr().unwrap();
        let srv = std::thread::spawn(move || {
            for _ in 0..3 {
                let req = server.recv_req().unwrap();
                let mut body = req.payload.to_vec();
                body.reverse();
                let resp = OutReq {
                    app_id: req.app_id,
                    req_type: req.req_type,
                    payload: Bytes::from(body),
                    dispatch_len: 0,
                };
                server.respond(&req, &resp).unwrap();
            }
        });
        for i in 0..3u8 {
            let req = OutReq {
                app_id: 2,
                req_type: i,
                payload: Bytes::from(vec![i, 1, 2]),
                dispatch_len: 1,
            };
            let resp = client.send_req(to, &req).unwrap();
            assert_eq!(&resp.payload[..], &[2, 1, i]);
            assert_eq!(resp.req_type, i);
        }
        srv.join().unwrap();
    }
}
