/* Connection rate limit of tcp listeners (`connection_rate_limit`), enforced before the proxy
 * sees the connection.
 *
 * A socket filter (SO_ATTACH_BPF) on every listening socket of a limited listener's
 * SO_REUSEPORT group. TCP runs a listening socket's filter on each segment addressed to it
 * (tcp_v4_rcv / tcp_v6_rcv -> tcp_filter) before tcp_conn_request, with skb->data at the TCP
 * header. The filter counts pure SYNs (SYN set, ACK and RST clear) against a token bucket per
 * listener port and passes every other segment (the handshake's last ACK included). A SYN
 * over the limit is dropped: no request socket is created and no SYN-ACK sent, so the client
 * sees no answer and retransmits its SYN (after 1 s, then 2 s, ...), as when a listener's
 * accept queue overflows. It is a drop, not a reset.
 *
 * The bucket is the one user space keeps (crates/proxy/src/resilience/rate_limit.rs): GCRA's
 * theoretical arrival time (TAT), in bpf_ktime_get_ns nanoseconds. A SYN at `now` is admitted
 * when max(TAT, now) + interval <= now + tolerance (tolerance = burst * interval), and moves the
 * TAT on by one interval, with a compare-and-swap (BPF_CMPXCHG, built with -mcpu=v3), so SYNs
 * handled on several CPUs at once share one exact bucket.
 *
 * Accepted sockets inherit their listener's filter (sk_clone_lock copies sk_filter): on them
 * the program reads the flags byte and passes the segment.
 *
 * The filter's return value is the number of bytes to keep: 0 drops, skb->len keeps all of
 * it (anything smaller would trim the payload). */
#include "common.h"

#define FM_TCP_SYN 0x02
#define FM_TCP_RST 0x04
#define FM_TCP_ACK 0x10
/* Compare-and-swap rounds before a SYN is given up as over the limit: each failed round means
 * another CPU just took a token, so running out means SYNs are arriving far above any rate. */
#define FM_CAS_TRIES 8

/* One listener's bucket, written whole by the node (a hash map update swaps the element at
 * once, so the program never sees a torn one); only `tat` is written by the program. */
struct fm_conn_limit {
	__u64 tat;       /* theoretical arrival time; 0: the bucket is full */
	__u64 interval;  /* nanoseconds between two connections at the sustained rate */
	__u64 tolerance; /* burst * interval */
};

/* Listener port (host byte order) -> its bucket. A port without an entry is not limited. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u16);
	__type(value, struct fm_conn_limit);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_conn_limits SEC(".maps");

/* Listener port -> SYNs dropped, per CPU (summed by the node for /metrics). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u16);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_conn_drops SEC(".maps");

static __always_inline void fm_count_drop(__u16 port)
{
	__u64 *n = bpf_map_lookup_elem(&fm_conn_drops, &port);
	if (n) {
		/* This CPU's slot: no atomics needed. */
		*n += 1;
		return;
	}
	__u64 one = 1;
	/* First drop on this port: another CPU may create the entry at the same time, and then
	 * this one drop goes uncounted. */
	bpf_map_update_elem(&fm_conn_drops, &port, &one, BPF_NOEXIST);
}

SEC("socket")
int fm_conn_limit(struct __sk_buff *skb)
{
	int keep = skb->len;
	/* Source port, destination port, sequence and acknowledgement numbers, offset, flags. */
	__u8 head[14];
	if (bpf_skb_load_bytes(skb, 0, head, sizeof(head)) < 0)
		return keep;
	if ((head[13] & (FM_TCP_SYN | FM_TCP_ACK | FM_TCP_RST)) != FM_TCP_SYN)
		return keep;
	__u16 port = ((__u16)head[2] << 8) | head[3];
	struct fm_conn_limit *l = bpf_map_lookup_elem(&fm_conn_limits, &port);
	if (!l)
		return keep;
	__u64 now = bpf_ktime_get_ns();
	__u64 interval = l->interval;
	__u64 limit = now + l->tolerance;
	for (int i = 0; i < FM_CAS_TRIES; i++) {
		__u64 old = *(volatile __u64 *)&l->tat;
		__u64 next = (old > now ? old : now) + interval;
		if (next > limit)
			break;
		if (__sync_val_compare_and_swap(&l->tat, old, next) == old)
			return keep;
	}
	fm_count_drop(port);
	return 0;
}
