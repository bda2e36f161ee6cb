/* Shared definitions for the flatmesh tier-K programs.
 * Every struct here has a #[repr(C)] twin in crates/kernel/src/abi.rs; keep them in sync. */
#pragma once
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define LIBBPF_PIN_BY_NAME 1
#define FM_AF_INET 2
#define FM_AF_INET6 10
#define FM_SK_PASS 1
#define FM_SK_DROP 0

/* Per-program counters, one slot per program, summed over CPUs by `flatmesh kernel status`. */
enum fm_stat_id {
	FM_ST_CONNECT4 = 0,
	FM_ST_CONNECT6 = 1,
	FM_ST_GETSOCKOPT = 2,
	FM_ST_SOCKOPS_CAPTURE = 3,
	FM_ST_SOCKOPS_REDIRECT = 4,
	FM_ST_SK_MSG = 5,
	FM_ST_PARSER = 6,
	FM_ST_VERDICT = 7,
	FM_ST_SOCKOPS_L7 = 8,
	/* Not a program: the part of fm_sk_msg's work that went straight from one end of a
	 * proxied connection to the other ("socket direct", see redirect.bpf.c). */
	FM_ST_SK_MSG_DIRECT = 9,
	/* Not programs either: one slot per reason the verdict left work to user space
	 * (FM_ST_WHY + FM_WHY_* of dispatch.bpf.c), counted in `fallbacks`, so `flatmesh kernel
	 * status` can say why connections were not decided in the kernel. */
	FM_ST_WHY = 10,
	FM_WHY_SLOTS = 16,
	FM_ST_MAX = FM_ST_WHY + FM_WHY_SLOTS,
};

struct fm_stat {
	__u64 runs;      /* times the program ran */
	__u64 bytes;     /* payload bytes it moved in the kernel (redirect / splice) */
	__u64 hits;      /* times it acted (captured, inserted, redirected, decided) */
	__u64 fallbacks; /* times it left the work to user space */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FM_ST_MAX);
	__type(key, __u32);
	__type(value, struct fm_stat);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_stats SEC(".maps");

static __always_inline struct fm_stat *fm_stat(__u32 id)
{
	return bpf_map_lookup_elem(&fm_stats, &id);
}

static __always_inline void fm_count(__u32 id, __u64 runs, __u64 bytes, __u64 hits, __u64 fallbacks)
{
	struct fm_stat *s = fm_stat(id);
	if (!s)
		return;
	/* Per-CPU slot: no atomics needed. */
	s->runs += runs;
	s->bytes += bytes;
	s->hits += hits;
	s->fallbacks += fallbacks;
}

/* An IPv4 or IPv6 endpoint. IPv4 uses ip[0] only; ports are host byte order. */
struct fm_addr {
	__u32 ip[4];
	__u16 port;
	__u8 family;
	__u8 pad;
};

/* Fills `a` from an IPv6 socket address, as IPv4 when it is v4-mapped (::ffff:a.b.c.d): a
 * dual-stack listener's accepted sockets are AF_INET6 with mapped addresses while their IPv4
 * clients are AF_INET, and both ends must produce the same keys. */
static __always_inline void fm_addr_ip6(struct fm_addr *a, __u32 w0, __u32 w1, __u32 w2, __u32 w3)
{
	if (w0 == 0 && w1 == 0 && w2 == bpf_htonl(0xffff)) {
		a->family = FM_AF_INET;
		a->ip[0] = w3;
		a->ip[1] = 0;
		a->ip[2] = 0;
		a->ip[3] = 0;
		return;
	}
	a->family = FM_AF_INET6;
	a->ip[0] = w0;
	a->ip[1] = w1;
	a->ip[2] = w2;
	a->ip[3] = w3;
}

/* A connection as seen from the client: client address -> address it reached (the proxy). */
struct fm_tuple {
	struct fm_addr client;
	struct fm_addr server;
};

char LICENSE[] SEC("license") = "GPL";

/* Node-wide settings, written by the loader at attach. */
struct fm_settings {
	/* The node's network namespace (its cookie): the sockops programs only take sockets
	 * in it, so two nodes in two namespaces on one host never touch each other's sockets.
	 * 0 = any namespace. */
	__u64 netns;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fm_settings);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_settings SEC(".maps");

/* Whether a sockops socket is in the node's network namespace. */
static __always_inline int fm_own_netns(struct bpf_sock_ops *skops)
{
	__u32 zero = 0;
	struct fm_settings *cfg = bpf_map_lookup_elem(&fm_settings, &zero);
	return !cfg || !cfg->netns || bpf_get_netns_cookie(skops) == cfg->netns;
}

/* Slot 0 holds the pid of the node that attached this pin directory, so the next start can
 * tell a live owner from a crashed one. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_owner SEC(".maps");
