//! Netlink message framing: the header and the attributes (`struct nlattr`) of a request, and a
//! bounded walk over the attributes of an answer.

/// `NLA_F_NESTED`: the attribute holds attributes.
pub const NESTED: u16 = 0x8000;
/// The type bits of an attribute (without `NLA_F_NESTED` and `NLA_F_NET_BYTEORDER`).
const TYPE_MASK: u16 = 0x3fff;
pub const HEADER_LEN: usize = std::mem::size_of::<libc::nlmsghdr>();

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// A request being written: a netlink header whose length is filled in by `finish`.
pub struct Request {
    bytes: Vec<u8>,
}

impl Request {
    pub fn new(kind: u16, flags: u16) -> Request {
        let mut bytes = Vec::with_capacity(128);
        bytes.extend_from_slice(&0u32.to_ne_bytes()); // length, set by `finish`
        bytes.extend_from_slice(&kind.to_ne_bytes());
        bytes.extend_from_slice(&flags.to_ne_bytes());
        bytes.extend_from_slice(&1u32.to_ne_bytes()); // sequence
        bytes.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills it in
        Request { bytes }
    }

    pub fn put(&mut self, bytes: &[u8]) {
        self.bytes.extend_from_slice(bytes);
    }

    /// An attribute with a payload, padded to four bytes.
    pub fn attribute(&mut self, kind: u16, payload: &[u8]) {
        self.put(&((4 + payload.len()) as u16).to_ne_bytes());
        self.put(&kind.to_ne_bytes());
        self.put(payload);
        self.bytes.resize(align4(self.bytes.len()), 0);
    }

    /// A nested attribute: `inner` writes its attributes.
    pub fn nest(&mut self, kind: u16, inner: impl FnOnce(&mut Request)) {
        let start = self.bytes.len();
        self.put(&[0, 0]);
        self.put(&(kind | NESTED).to_ne_bytes());
        inner(self);
        let len = (self.bytes.len() - start) as u16;
        self.bytes[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    }

    pub fn finish(mut self) -> Vec<u8> {
        let len = self.bytes.len() as u32;
        self.bytes[..4].copy_from_slice(&len.to_ne_bytes());
        self.bytes
    }
}

/// The first message of an answer: its type and its payload (after the header), if the
/// header is whole and its length lies within the bytes received.
pub fn first_message(bytes: &[u8]) -> Option<(u16, &[u8])> {
    let header = bytes.get(..HEADER_LEN)?;
    let len = u32::from_ne_bytes(header[..4].try_into().ok()?) as usize;
    let kind = u16::from_ne_bytes(header[4..6].try_into().ok()?);
    if len < HEADER_LEN {
        return None;
    }
    Some((kind, bytes.get(HEADER_LEN..len)?))
}

/// The attributes in `bytes`, as (type, payload); the walk stops at the first malformed one.
pub fn attributes(bytes: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut rest = bytes;
    std::iter::from_fn(move || {
        let len = u16::from_ne_bytes(rest.get(..2)?.try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(rest.get(2..4)?.try_into().ok()?);
        if len < 4 {
            return None;
        }
        let payload = rest.get(4..len)?;
        rest = rest.get(align4(len)..).unwrap_or(&[]);
        Some((kind & TYPE_MASK, payload))
    })
}

/// The payload of the first attribute of type `kind` in `bytes`.
pub fn find(bytes: &[u8], kind: u16) -> Option<&[u8]> {
    attributes(bytes).find(|(k, _)| *k == kind).map(|(_, p)| p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_attributes_are_written_and_read_back() {
        let mut request = Request::new(7, 1);
        request.nest(2, |r| {
            r.attribute(1, &[9]);
            r.attribute(3, &[1, 2, 3, 4, 5]);
        });
        request.attribute(4, &[]);
        let bytes = request.finish();
        let (kind, body) = first_message(&bytes).unwrap();
        assert_eq!(kind, 7);
        let outer: Vec<_> = attributes(body).collect();
        assert_eq!(outer.len(), 2);
        assert_eq!(outer[0].0, 2);
        assert_eq!(find(outer[0].1, 1), Some(&[9u8][..]));
        assert_eq!(find(outer[0].1, 3), Some(&[1u8, 2, 3, 4, 5][..]));
        assert_eq!(outer[1], (4, &[][..]));
    }

    #[test]
    fn malformed_attributes_end_the_walk() {
        // A length shorter than an attribute header, then one past the end.
        assert_eq!(attributes(&[2, 0, 1, 0, 9, 9, 9, 9]).count(), 0);
        assert_eq!(attributes(&[40, 0, 1, 0, 9, 9, 9, 9]).count(), 0);
        assert_eq!(attributes(&[]).count(), 0);
        // A message whose length runs past the bytes received.
        let mut long = vec![0u8; 20];
        long[..4].copy_from_slice(&100u32.to_ne_bytes());
        assert_eq!(first_message(&long), None);
    }
}
