//! A free port for a test, never the same one twice in one test process. Included by the
//! proxy's, the binary's, the xDS and the shm tests.

use std::net::TcpListener as StdTcpListener;

/// A port on 127.0.0.1 that was free a moment ago. The OS picks it (bind :0) so parallel
/// tests do not collide; the tiny window between release and reuse is acceptable here. The OS
/// may hand out the port it just gave back, so a test that asks twice (an admin address and
/// a listener) could get the same port twice: a port this process was already given is
/// skipped.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU64, Ordering};
    /// One bit per port: set once the port was handed out.
    static GIVEN: [AtomicU64; 1024] = [const { AtomicU64::new(0) }; 1024];
    for _ in 0..100 {
        let listener =
            StdTcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0 to pick a port");
        let port = listener
            .local_addr()
            .expect("local_addr of a bound socket")
            .port();
        let bit = 1u64 << (port % 64);
        if GIVEN[usize::from(port / 64)].fetch_or(bit, Ordering::Relaxed) & bit == 0 {
            return port;
        }
    }
    panic!("the OS gave 100 ports this test process had already used");
}
