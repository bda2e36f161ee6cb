/* Local-hop redirect (FlatProxy "socket direct" on Linux).
 *
 * 1. Hop shortening: sockops puts both ends of a local hop (app <-> proxy, proxy <-> local
 *    backend) into a sockhash, and sk_msg moves each sendmsg straight into the peer's receive
 *    queue, so the bytes never cross the TCP/IP stack.
 * 2. Socket direct: once the proxy has opened the upstream of a connection whose client and
 *    backend are both local, it arms a shortcut for each direction: the client's sendmsg goes
 *    into the *backend's* socket (and back), skipping the proxy altogether. The proxy keeps
 *    both TCP connections open, so FIN and RST still travel through it and it keeps its
 *    half-close, reset and accounting semantics; only the payload goes direct.
 *
 * Ordering. Bytes a sender wrote before the shortcut took effect went to the proxy, which
 * forwards them through its upstream socket (itself redirected into the same receive queue).
 * A message may only go direct once every earlier byte has been forwarded: the proxy arms a
 * direction with the number of bytes it has forwarded so far (`armed_at`), this program counts
 * the bytes each sender sent toward the proxy (`fm_hop_sent`, per socket), and a message goes
 * direct only while the two are equal. Otherwise it takes the proxy path, and the proxy arms
 * again after forwarding it. So the receiver sees the bytes in the order they were sent. */
#include "common.h"

/* A socket's own view: local and remote endpoints. Loopback addresses carry the netns cookie
 * so equal 127.0.0.1 tuples in two namespaces cannot be confused. */
struct fm_sock_key {
	struct fm_addr local;
	struct fm_addr remote;
	__u64 netns;
};

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 65536);
	__type(key, struct fm_sock_key);
	__type(value, __u32); /* socket fd on update */
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_redirect_socks SEC(".maps");

enum {
	/* Both ends of connections to this port are local-hop members. */
	FM_PORT_BOTH = 1,
	/* Only the connecting end: the accepted end belongs to the L7 dispatcher (sk_skb), which
	 * must see the client's bytes arrive through TCP. */
	FM_PORT_CLIENT = 2,
};

/* port -> FM_PORT_*: a connection is a local hop when its server end listens on one of these
 * ports (the proxy's listeners and local backends). Only the server's port is looked at, so a
 * client's ephemeral port that happens to equal a marked port cannot make it a member. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u16);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_redirect_ports SEC(".maps");

/* One direction of a socket-direct connection, written by the proxy only. */
struct fm_shortcut {
	struct fm_sock_key target; /* the receiving end's own key */
	__u64 armed_at;            /* bytes of this sender the proxy has forwarded so far */
};

/* sender's own key -> shortcut. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct fm_sock_key);
	__type(value, struct fm_shortcut);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_shortcuts SEC(".maps");

/* Bytes and messages that went direct, per sender key; created by the proxy when it arms,
 * added to here, read and removed by the proxy when the connection ends. */
struct fm_direct {
	__u64 bytes;
	__u64 msgs;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct fm_sock_key);
	__type(value, struct fm_direct);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_direct_bytes SEC(".maps");

/* Per socket: bytes it sent toward its peer (the proxy) rather than direct. Socket storage
 * lives and dies with the socket. */
struct fm_hop {
	__u64 sent;
};

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct fm_hop);
} fm_hop_sent SEC(".maps");

static __always_inline int fm_is_loopback(const struct fm_addr *a)
{
	if (a->family == FM_AF_INET)
		return (bpf_ntohl(a->ip[0]) >> 24) == 127;
	return a->ip[0] == 0 && a->ip[1] == 0 && a->ip[2] == 0 && a->ip[3] == bpf_htonl(1);
}

SEC("sockops")
int fm_sockops_redirect(struct bpf_sock_ops *skops)
{
	__u32 op = skops->op;
	if (op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB && op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB)
		return 1;
	__u32 family = skops->family;
	if ((family != FM_AF_INET && family != FM_AF_INET6) || !fm_own_netns(skops))
		return 1;
	struct fm_sock_key key = {};
	if (family == FM_AF_INET) {
		key.local.family = FM_AF_INET;
		key.remote.family = FM_AF_INET;
		key.local.ip[0] = skops->local_ip4;
		key.remote.ip[0] = skops->remote_ip4;
	} else {
		fm_addr_ip6(&key.local, skops->local_ip6[0], skops->local_ip6[1],
			    skops->local_ip6[2], skops->local_ip6[3]);
		fm_addr_ip6(&key.remote, skops->remote_ip6[0], skops->remote_ip6[1],
			    skops->remote_ip6[2], skops->remote_ip6[3]);
	}
	key.local.port = (__u16)skops->local_port;
	key.remote.port = (__u16)bpf_ntohl(skops->remote_port);
	/* The server end's port: ours when we accepted, the peer's when we connected. */
	int passive = op == BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB;
	__u16 server_port = passive ? key.local.port : key.remote.port;
	__u8 *mode = bpf_map_lookup_elem(&fm_redirect_ports, &server_port);
	if (!mode || (passive && *mode != FM_PORT_BOTH)) {
		fm_count(FM_ST_SOCKOPS_REDIRECT, 1, 0, 0, 0);
		return 1;
	}
	if (fm_is_loopback(&key.local))
		key.netns = bpf_get_netns_cookie(skops);
	long err = bpf_sock_hash_update(skops, &fm_redirect_socks, &key, BPF_NOEXIST);
	fm_count(FM_ST_SOCKOPS_REDIRECT, 1, 0, err == 0, err != 0);
	return 1;
}

SEC("sk_msg")
int fm_sk_msg(struct sk_msg_md *msg)
{
	struct fm_sock_key self = {};
	__u32 family = msg->family;
	if (family == FM_AF_INET) {
		self.local.family = FM_AF_INET;
		self.remote.family = FM_AF_INET;
		self.local.ip[0] = msg->local_ip4;
		self.remote.ip[0] = msg->remote_ip4;
	} else {
		fm_addr_ip6(&self.local, msg->local_ip6[0], msg->local_ip6[1], msg->local_ip6[2],
			    msg->local_ip6[3]);
		fm_addr_ip6(&self.remote, msg->remote_ip6[0], msg->remote_ip6[1],
			    msg->remote_ip6[2], msg->remote_ip6[3]);
	}
	self.local.port = (__u16)msg->local_port;
	self.remote.port = (__u16)bpf_ntohl(msg->remote_port);
	if (fm_is_loopback(&self.local))
		self.netns = bpf_get_netns_cookie(msg);
	__u64 size = msg->size;

	struct bpf_sock *sk = msg->sk;
	struct fm_hop *hop = 0;
	if (sk)
		hop = bpf_sk_storage_get(&fm_hop_sent, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);

	/* Socket direct: only while the proxy has forwarded everything sent its way. */
	struct fm_shortcut *sc = bpf_map_lookup_elem(&fm_shortcuts, &self);
	if (sc && hop && hop->sent == sc->armed_at) {
		struct fm_sock_key target = sc->target;
		if (bpf_msg_redirect_hash(msg, &fm_redirect_socks, &target, BPF_F_INGRESS) ==
		    FM_SK_PASS) {
			struct fm_direct *d = bpf_map_lookup_elem(&fm_direct_bytes, &self);
			if (d) {
				__sync_fetch_and_add(&d->bytes, size);
				__sync_fetch_and_add(&d->msgs, 1);
			}
			fm_count(FM_ST_SK_MSG, 1, size, 1, 0);
			fm_count(FM_ST_SK_MSG_DIRECT, 1, size, 1, 0);
			return FM_SK_PASS;
		}
		/* The target is gone: the proxy path below carries the bytes (and the close). */
	}
	/* Whatever does not go direct goes to the peer, the proxy: count it first, whether the
	 * redirect below succeeds or the bytes take TCP. */
	if (hop)
		hop->sent += size;

	/* The peer's key is our key with the ends swapped. */
	struct fm_sock_key peer = {};
	peer.local = self.remote;
	peer.remote = self.local;
	peer.netns = self.netns;
	long verdict = bpf_msg_redirect_hash(msg, &fm_redirect_socks, &peer, BPF_F_INGRESS);
	if (verdict == FM_SK_PASS) {
		fm_count(FM_ST_SK_MSG, 1, size, 1, 0);
		return FM_SK_PASS;
	}
	/* Peer not in the map (not local, or gone): send through TCP as usual. */
	fm_count(FM_ST_SK_MSG, 1, 0, 0, 1);
	return FM_SK_PASS;
}
