/* Local-hop redirect (FlatProxy "socket direct" on Linux): sockops puts both ends of a local
 * hop into a sockhash, and sk_msg moves each sendmsg straight into the peer's receive queue,
 * so the bytes never cross the TCP/IP stack. */
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

/* port -> 1: a connection is a local hop to shorten when either end uses one of these ports
 * (the proxy's listeners and local backends). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u16);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_redirect_ports SEC(".maps");

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
	if (family != FM_AF_INET && family != FM_AF_INET6)
		return 1;
	struct fm_sock_key key = {};
	key.local.family = family;
	key.remote.family = family;
	if (family == FM_AF_INET) {
		key.local.ip[0] = skops->local_ip4;
		key.remote.ip[0] = skops->remote_ip4;
	} else {
		key.local.ip[0] = skops->local_ip6[0];
		key.local.ip[1] = skops->local_ip6[1];
		key.local.ip[2] = skops->local_ip6[2];
		key.local.ip[3] = skops->local_ip6[3];
		key.remote.ip[0] = skops->remote_ip6[0];
		key.remote.ip[1] = skops->remote_ip6[1];
		key.remote.ip[2] = skops->remote_ip6[2];
		key.remote.ip[3] = skops->remote_ip6[3];
	}
	key.local.port = (__u16)skops->local_port;
	key.remote.port = (__u16)bpf_ntohl(skops->remote_port);
	__u16 lp = key.local.port, rp = key.remote.port;
	if (!bpf_map_lookup_elem(&fm_redirect_ports, &lp) &&
	    !bpf_map_lookup_elem(&fm_redirect_ports, &rp)) {
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
	/* The peer's key is our key with the ends swapped. */
	struct fm_sock_key peer = {};
	__u32 family = msg->family;
	peer.local.family = family;
	peer.remote.family = family;
	if (family == FM_AF_INET) {
		peer.local.ip[0] = msg->remote_ip4;
		peer.remote.ip[0] = msg->local_ip4;
	} else {
		peer.local.ip[0] = msg->remote_ip6[0];
		peer.local.ip[1] = msg->remote_ip6[1];
		peer.local.ip[2] = msg->remote_ip6[2];
		peer.local.ip[3] = msg->remote_ip6[3];
		peer.remote.ip[0] = msg->local_ip6[0];
		peer.remote.ip[1] = msg->local_ip6[1];
		peer.remote.ip[2] = msg->local_ip6[2];
		peer.remote.ip[3] = msg->local_ip6[3];
	}
	peer.local.port = (__u16)bpf_ntohl(msg->remote_port);
	peer.remote.port = (__u16)msg->local_port;
	if (fm_is_loopback(&peer.local))
		peer.netns = bpf_get_netns_cookie(msg);
	__u64 size = msg->size;
	long verdict = bpf_msg_redirect_hash(msg, &fm_redirect_socks, &peer, BPF_F_INGRESS);
	if (verdict == FM_SK_PASS) {
		fm_count(FM_ST_SK_MSG, 1, size, 1, 0);
		return FM_SK_PASS;
	}
	/* Peer not in the map (not local, or gone): send through TCP as usual. */
	fm_count(FM_ST_SK_MSG, 1, 0, 0, 1);
	return FM_SK_PASS;
}
