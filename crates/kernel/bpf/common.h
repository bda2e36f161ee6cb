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
	FM_ST_MAX = 9,
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

/* A connection as seen from the client: client address -> address it reached (the proxy). */
struct fm_tuple {
	struct fm_addr client;
	struct fm_addr server;
};

char LICENSE[] SEC("license") = "GPL";

/* Slot 0 holds the pid of the node that attached this pin directory, so the next start can
 * tell a live owner from a crashed one. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_owner SEC(".maps");
