/* Capture: cgroup/connect4+6 send connections to configured service addresses to the node
 * proxy, and remember where they were going so the proxy can recover it, by socket cookie
 * or with getsockopt(SO_ORIGINAL_DST) answered by cgroup/getsockopt. They also remember who
 * made each captured connection (the client process's cgroup and uid, read in its own
 * context, so nothing the client sends can change them): the node names the connection's
 * workload from it (fm_src_by_tuple). */
#include "common.h"

#define FM_SO_ORIGINAL_DST 80
#define FM_SOL_IP 0
#define FM_SOL_IPV6 41

/* service address -> proxy address to send it to */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct fm_addr);
	__type(value, struct fm_addr);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_services SEC(".maps");

/* tgid -> 1: processes whose connections are never captured (the proxy itself). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_bypass_pids SEC(".maps");

/* socket cookie -> original destination, for both the captured client socket and the
 * proxy's accepted socket. LRU so a lost close event cannot fill it. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, struct fm_addr);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_orig_by_cookie SEC(".maps");

/* (client, proxy) -> original destination: how the proxy side finds what the client wanted. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct fm_tuple);
	__type(value, struct fm_addr);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_orig_by_tuple SEC(".maps");

/* Who made a captured connection. */
struct fm_source {
	__u64 cgroup_id; /* the client process's cgroup v2 id (the cgroup directory's inode) */
	__u32 uid;       /* its real user id */
	__u32 pad;
};

/* client socket cookie -> source, from connect4/6 until the client's sockops re-keys it. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, struct fm_source);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_src_by_cookie SEC(".maps");

/* (client, proxy) -> source: how the node finds who made a connection it accepted. LRU, and
 * removed when the proxy's end closes, so a later connection on the same 4-tuple never
 * inherits an old source. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct fm_tuple);
	__type(value, struct fm_source);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_src_by_tuple SEC(".maps");

/* Records the calling process as the source of the socket `cookie` is connecting. */
static __always_inline void fm_record_source(__u64 cookie)
{
	struct fm_source src = {};
	src.cgroup_id = bpf_get_current_cgroup_id();
	src.uid = (__u32)bpf_get_current_uid_gid();
	bpf_map_update_elem(&fm_src_by_cookie, &cookie, &src, BPF_ANY);
}

static __always_inline int fm_bypassed(void)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	return bpf_map_lookup_elem(&fm_bypass_pids, &tgid) != 0;
}

SEC("cgroup/connect4")
int fm_connect4(struct bpf_sock_addr *ctx)
{
	if (ctx->protocol != IPPROTO_TCP || fm_bypassed()) {
		fm_count(FM_ST_CONNECT4, 1, 0, 0, 0);
		return 1;
	}
	struct fm_addr key = {};
	key.family = FM_AF_INET;
	key.ip[0] = ctx->user_ip4;
	key.port = bpf_ntohs((__u16)ctx->user_port);
	struct fm_addr *proxy = bpf_map_lookup_elem(&fm_services, &key);
	if (!proxy) {
		fm_count(FM_ST_CONNECT4, 1, 0, 0, 0);
		return 1;
	}
	__u64 cookie = bpf_get_socket_cookie(ctx);
	bpf_map_update_elem(&fm_orig_by_cookie, &cookie, &key, BPF_ANY);
	fm_record_source(cookie);
	ctx->user_ip4 = proxy->ip[0];
	ctx->user_port = bpf_htons(proxy->port);
	fm_count(FM_ST_CONNECT4, 1, 0, 1, 0);
	return 1;
}

SEC("cgroup/connect6")
int fm_connect6(struct bpf_sock_addr *ctx)
{
	if (ctx->protocol != IPPROTO_TCP || fm_bypassed()) {
		fm_count(FM_ST_CONNECT6, 1, 0, 0, 0);
		return 1;
	}
	/* A v4-mapped destination (a dual-stack socket reaching an IPv4 service) is looked up
	 * as the IPv4 address it is. */
	struct fm_addr key = {};
	fm_addr_ip6(&key, ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3]);
	key.port = bpf_ntohs((__u16)ctx->user_port);
	struct fm_addr *proxy = bpf_map_lookup_elem(&fm_services, &key);
	if (!proxy) {
		fm_count(FM_ST_CONNECT6, 1, 0, 0, 0);
		return 1;
	}
	__u64 cookie = bpf_get_socket_cookie(ctx);
	bpf_map_update_elem(&fm_orig_by_cookie, &cookie, &key, BPF_ANY);
	fm_record_source(cookie);
	if (proxy->family == FM_AF_INET) {
		ctx->user_ip6[0] = 0;
		ctx->user_ip6[1] = 0;
		ctx->user_ip6[2] = bpf_htonl(0xffff);
		ctx->user_ip6[3] = proxy->ip[0];
	} else {
		ctx->user_ip6[0] = proxy->ip[0];
		ctx->user_ip6[1] = proxy->ip[1];
		ctx->user_ip6[2] = proxy->ip[2];
		ctx->user_ip6[3] = proxy->ip[3];
	}
	ctx->user_port = bpf_htons(proxy->port);
	fm_count(FM_ST_CONNECT6, 1, 0, 1, 0);
	return 1;
}

/* Local and remote endpoint of a sock_ops socket, ports in host order, v4-mapped addresses
 * as IPv4 (fm_addr_ip6). */
static __always_inline void fm_sockops_ends(struct bpf_sock_ops *skops, struct fm_addr *local,
					    struct fm_addr *remote)
{
	if (skops->family == FM_AF_INET) {
		local->family = FM_AF_INET;
		remote->family = FM_AF_INET;
		local->ip[0] = skops->local_ip4;
		remote->ip[0] = skops->remote_ip4;
	} else {
		fm_addr_ip6(local, skops->local_ip6[0], skops->local_ip6[1], skops->local_ip6[2],
			    skops->local_ip6[3]);
		fm_addr_ip6(remote, skops->remote_ip6[0], skops->remote_ip6[1],
			    skops->remote_ip6[2], skops->remote_ip6[3]);
	}
	local->port = (__u16)skops->local_port;
	/* remote_port holds the big-endian port in its upper half on little-endian hosts. */
	remote->port = (__u16)bpf_ntohl(skops->remote_port);
}

SEC("sockops")
int fm_sockops_capture(struct bpf_sock_ops *skops)
{
	__u32 op = skops->op;
	if (skops->family != FM_AF_INET && skops->family != FM_AF_INET6)
		return 1;
	struct fm_tuple t = {};
	__u64 cookie = bpf_get_socket_cookie(skops);
	if (op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB) {
		/* The client side: if connect4/6 captured it, publish the (client, proxy) tuple. */
		struct fm_addr *orig = bpf_map_lookup_elem(&fm_orig_by_cookie, &cookie);
		if (!orig) {
			fm_count(FM_ST_SOCKOPS_CAPTURE, 1, 0, 0, 0);
			return 1;
		}
		struct fm_addr o = *orig;
		fm_sockops_ends(skops, &t.client, &t.server);
		bpf_map_update_elem(&fm_orig_by_tuple, &t, &o, BPF_ANY);
		/* The source moves to the tuple the node sees (its peer, its own address), and
		 * before the client's ACK, so it is there when the node accepts. */
		struct fm_source *src = bpf_map_lookup_elem(&fm_src_by_cookie, &cookie);
		if (src) {
			struct fm_source s = *src;
			bpf_map_update_elem(&fm_src_by_tuple, &t, &s, BPF_ANY);
			bpf_map_delete_elem(&fm_src_by_cookie, &cookie);
		}
		bpf_sock_ops_cb_flags_set(skops, BPF_SOCK_OPS_STATE_CB_FLAG);
		fm_count(FM_ST_SOCKOPS_CAPTURE, 1, 0, 1, 0);
	} else if (op == BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB) {
		/* The proxy side: copy the original destination under the accepted socket's cookie. */
		fm_sockops_ends(skops, &t.server, &t.client);
		struct fm_addr *orig = bpf_map_lookup_elem(&fm_orig_by_tuple, &t);
		if (!orig) {
			fm_count(FM_ST_SOCKOPS_CAPTURE, 1, 0, 0, 0);
			return 1;
		}
		struct fm_addr o = *orig;
		bpf_map_update_elem(&fm_orig_by_cookie, &cookie, &o, BPF_ANY);
		bpf_sock_ops_cb_flags_set(skops, BPF_SOCK_OPS_STATE_CB_FLAG);
		fm_count(FM_ST_SOCKOPS_CAPTURE, 1, 0, 1, 0);
	} else if (op == BPF_SOCK_OPS_STATE_CB && skops->args[1] == BPF_TCP_CLOSE) {
		/* Forget a socket's entries when it closes. The tuple entry belongs to the proxy
		 * side, which may still ask for it after the client has gone. */
		if (bpf_map_lookup_elem(&fm_orig_by_cookie, &cookie)) {
			bpf_map_delete_elem(&fm_orig_by_cookie, &cookie);
			bpf_map_delete_elem(&fm_src_by_cookie, &cookie);
			fm_sockops_ends(skops, &t.server, &t.client);
			bpf_map_delete_elem(&fm_orig_by_tuple, &t);
			bpf_map_delete_elem(&fm_src_by_tuple, &t);
		}
		fm_count(FM_ST_SOCKOPS_CAPTURE, 1, 0, 0, 0);
	}
	return 1;
}

SEC("cgroup/getsockopt")
int fm_getsockopt(struct bpf_sockopt *ctx)
{
	if (ctx->optname != FM_SO_ORIGINAL_DST ||
	    (ctx->level != FM_SOL_IP && ctx->level != FM_SOL_IPV6))
		return 1;
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return 1;
	struct fm_tuple t = {};
	__u32 family = sk->family;
	if (family == FM_AF_INET) {
		t.client.family = FM_AF_INET;
		t.server.family = FM_AF_INET;
		t.client.ip[0] = sk->dst_ip4;
		t.server.ip[0] = sk->src_ip4;
	} else if (family == FM_AF_INET6) {
		fm_addr_ip6(&t.client, sk->dst_ip6[0], sk->dst_ip6[1], sk->dst_ip6[2], sk->dst_ip6[3]);
		fm_addr_ip6(&t.server, sk->src_ip6[0], sk->src_ip6[1], sk->src_ip6[2], sk->src_ip6[3]);
	} else {
		return 1;
	}
	t.client.port = bpf_ntohs((__u16)sk->dst_port);
	t.server.port = (__u16)sk->src_port;
	struct fm_addr *o = bpf_map_lookup_elem(&fm_orig_by_tuple, &t);
	if (!o) {
		fm_count(FM_ST_GETSOCKOPT, 1, 0, 0, 1);
		return 1; /* keep the kernel's own answer (conntrack or ENOENT) */
	}
	if (ctx->level == FM_SOL_IP && o->family == FM_AF_INET) {
		struct sockaddr_in *sa = ctx->optval;
		if ((void *)(sa + 1) > ctx->optval_end)
			return 1;
		sa->sin_family = FM_AF_INET;
		sa->sin_port = bpf_htons(o->port);
		sa->sin_addr.s_addr = o->ip[0];
		ctx->optlen = sizeof(*sa);
	} else if (ctx->level == FM_SOL_IPV6) {
		/* An IPv4 destination asked for on a dual-stack socket comes back v4-mapped. */
		struct sockaddr_in6 *sa6 = ctx->optval;
		if ((void *)(sa6 + 1) > ctx->optval_end)
			return 1;
		int v4 = o->family == FM_AF_INET;
		__builtin_memset(sa6, 0, sizeof(*sa6));
		sa6->sin6_family = FM_AF_INET6;
		sa6->sin6_port = bpf_htons(o->port);
		sa6->sin6_addr.in6_u.u6_addr32[0] = v4 ? 0 : o->ip[0];
		sa6->sin6_addr.in6_u.u6_addr32[1] = v4 ? 0 : o->ip[1];
		sa6->sin6_addr.in6_u.u6_addr32[2] = v4 ? bpf_htonl(0xffff) : o->ip[2];
		sa6->sin6_addr.in6_u.u6_addr32[3] = v4 ? o->ip[0] : o->ip[3];
		ctx->optlen = sizeof(*sa6);
	} else {
		return 1;
	}
	/* One store site: clang would otherwise merge per-branch stores into a computed
	 * context pointer, which the verifier rejects. */
	ctx->retval = 0;
	fm_count(FM_ST_GETSOCKOPT, 1, 0, 1, 0);
	return 1;
}
