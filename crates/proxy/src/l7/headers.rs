//! Header edits on requests and responses held in `http` types (the HTTP/2 side; the HTTP/1
//! path writes the same edits straight into its head, `crate::h1::head`): hop-by-hop fields
//! out, the route's additions and removals, x-forwarded-for.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, Version};

use flatmesh_config::UpstreamProtocol;
use flatmesh_rules::CompiledRoute;

/// hop-by-hop headers (RFC 9110 §7.6.1) are never forwarded.
const HOP_BY_HOP: [HeaderName; 6] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
];

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// Whether a header is hop-by-hop: `te` only when it carries more than "trailers" (what
/// every gRPC request sends, and may go on).
fn is_hop_by_hop(name: &HeaderName, value: &HeaderValue) -> bool {
    HOP_BY_HOP.contains(name) || (name == header::TE && value.as_bytes() != b"trailers")
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Fast path: most requests carry none, and one pass over the names is far cheaper than
    // a hashed remove per hop-by-hop name.
    if !headers
        .iter()
        .any(|(name, value)| is_hop_by_hop(name, value))
    {
        return;
    }
    // Headers named in `Connection` are hop-by-hop too.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::try_from(n.trim()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
    // `te` may only carry "trailers" (gRPC needs it); anything else is hop-by-hop.
    if headers
        .get(header::TE)
        .is_some_and(|v| v.as_bytes() != b"trailers")
    {
        headers.remove(header::TE);
    }
}

pub(crate) fn add_headers(headers: &mut HeaderMap, add: &[(HeaderName, HeaderValue)]) {
    for (name, value) in add {
        headers.insert(name.clone(), value.clone());
    }
}

/// `peer_ip` is the client's address as a header value, made once per connection.
fn append_forwarded_for(headers: &mut HeaderMap, peer_ip: &HeaderValue) {
    match headers.entry(X_FORWARDED_FOR) {
        header::Entry::Vacant(e) => {
            e.insert(peer_ip.clone());
        }
        header::Entry::Occupied(mut e) => {
            let mut joined = e.get().as_bytes().to_vec();
            joined.extend_from_slice(b", ");
            joined.extend_from_slice(peer_ip.as_bytes());
            if let Ok(v) = HeaderValue::from_bytes(&joined) {
                e.insert(v);
            }
        }
    }
}

/// The request as it goes upstream, the same for every try: Host where the upstream needs
/// one, hop-by-hop fields out, the route's edits, x-forwarded-for.
pub(crate) fn edit_request(
    parts: &mut http::request::Parts,
    route: &CompiledRoute,
    upstream: UpstreamProtocol,
    peer_ip: &HeaderValue,
) {
    // An HTTP/1 upstream needs Host: from :authority for an h2 client (it wins over any
    // Host header), from an absolute-form target for an h1 client that sent none.
    let needs_host = match parts.version {
        Version::HTTP_2 => upstream == UpstreamProtocol::Http1,
        _ => !parts.headers.contains_key(header::HOST),
    };
    if needs_host {
        if let Some(v) = parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        {
            parts.headers.insert(header::HOST, v);
        }
    }
    strip_hop_by_hop(&mut parts.headers);
    for name in &route.request_headers_to_remove {
        parts.headers.remove(name);
    }
    add_headers(&mut parts.headers, &route.request_headers_to_add);
    append_forwarded_for(&mut parts.headers, peer_ip);
}

/// The upstream's response as it goes to the client: hop-by-hop fields out, the route's
/// response headers in.
pub(crate) fn edit_response<B>(resp: Response<B>, route: &CompiledRoute) -> Response<B> {
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    add_headers(&mut parts.headers, &route.response_headers_to_add);
    Response::from_parts(parts, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::try_from(*k).expect("name"),
                HeaderValue::from_str(v).expect("value"),
            );
        }
        h
    }

    #[test]
    fn hop_by_hop_headers_are_stripped() {
        let mut h = headers(&[
            ("connection", "x-secret, close"),
            ("x-secret", "1"),
            ("te", "gzip"),
            ("x-keep", "1"),
        ]);
        strip_hop_by_hop(&mut h);
        assert!(
            h.get("x-secret").is_none() && h.get("te").is_none() && h.get("connection").is_none()
        );
        assert!(h.get("x-keep").is_some());
        let mut grpc = headers(&[("te", "trailers")]);
        strip_hop_by_hop(&mut grpc);
        assert!(grpc.get("te").is_some(), "gRPC's te: trailers must pass");
        // Alone, another `te` is still hop-by-hop; beside `connection`, trailers still pass.
        let mut te = headers(&[("te", "gzip"), ("x-keep", "1")]);
        strip_hop_by_hop(&mut te);
        assert!(te.get("te").is_none() && te.get("x-keep").is_some());
        let mut both = headers(&[
            ("te", "trailers"),
            ("connection", "x-secret"),
            ("x-secret", "1"),
        ]);
        strip_hop_by_hop(&mut both);
        assert!(both.get("x-secret").is_none() && both.get("te").is_some());
    }

    #[test]
    fn forwarded_for_appends() {
        let mut h = headers(&[("x-forwarded-for", "10.0.0.1")]);
        append_forwarded_for(&mut h, &HeaderValue::from_static("127.0.0.1"));
        assert_eq!(
            h.get("x-forwarded-for").and_then(|v| v.to_str().ok()),
            Some("10.0.0.1, 127.0.0.1")
        );
    }
}
