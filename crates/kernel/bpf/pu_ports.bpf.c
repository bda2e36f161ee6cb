/* The global port table of a split network namespace (HeteroPod §4.1.1), enforced at bind().
 *
 * A split namespace's processing units (PUs) are network namespaces on one kernel. To their
 * programs they must look like one namespace: a TCP port bound on one PU cannot be bound on
 * another. cgroup/bind4 and cgroup/bind6, attached at the cgroup v2 root, see every bind() on
 * the host. The program finds the PU of the binding socket by its network namespace cookie
 * (fm_pu_netns, written when the PUs are created; binds from any other namespace pass
 * untouched) and claims the port for that PU in fm_pu_ports with BPF_NOEXIST: of two binds
 * racing for a free port on two CPUs, exactly one insert succeeds. A bind of a port another PU
 * owns fails with EADDRINUSE before the kernel looks at its own port tables, so there is no
 * window between the bind and the table.
 *
 * Not claimed here: port 0 (the kernel picks an ephemeral port after this hook; the PU agent
 * claims such a port when it sees it listening), and other protocols than TCP. Releasing is
 * the agent's job: it deletes a port of its PU once nothing on the PU holds it any more.
 *
 * One object is loaded per split namespace, with its maps pinned in that namespace's own
 * directory, so namespaces never see each other's ports. Keys and values have #[repr(C)] twins
 * in crates/kernel/src/pu_ports.rs. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define LIBBPF_PIN_BY_NAME 1
#define FM_IPPROTO_TCP 6
#define FM_EADDRINUSE 98
/* Binds let through and refused: bpf_sock_addr programs return 1 to allow, 0 to refuse. */
#define FM_BIND_ALLOW 1
#define FM_BIND_REFUSE 0
/* Most PUs of one split namespace (the pu crate allows 2 to 8). */
#define FM_PU_MAX 8
/* Most ports in one table: every TCP port but 0. */
#define FM_PU_PORTS_MAX 65535

struct fm_pu_port {
	__u16 port;  /* host byte order */
	__u8 proto;  /* IPPROTO_TCP */
	__u8 pad;
};

struct fm_pu_owner {
	__u32 pu;    /* index of the owner PU in the split namespace's config */
	__u32 pad;
};

/* Network namespace cookie -> index of the PU that namespace is. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, FM_PU_MAX);
	__type(key, __u64);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_pu_netns SEC(".maps");

/* The global port table: (port, protocol) -> owner PU. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, FM_PU_PORTS_MAX);
	__type(key, struct fm_pu_port);
	__type(value, struct fm_pu_owner);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_pu_ports SEC(".maps");

/* Per-CPU counters for `flatmesh pu status`: slot 0 binds claimed, slot 1 binds refused. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_pu_bind_stats SEC(".maps");

static __always_inline void fm_pu_count(__u32 slot)
{
	__u64 *n = bpf_map_lookup_elem(&fm_pu_bind_stats, &slot);
	if (n)
		*n += 1;
}

static __always_inline int fm_pu_bind(struct bpf_sock_addr *ctx)
{
	if (ctx->protocol != FM_IPPROTO_TCP)
		return FM_BIND_ALLOW;
	/* user_port holds the port in network byte order in its low 16 bits. */
	__u16 port = bpf_ntohs((__u16)ctx->user_port);
	if (port == 0)
		return FM_BIND_ALLOW;
	__u64 cookie = bpf_get_netns_cookie(ctx);
	__u32 *pu = bpf_map_lookup_elem(&fm_pu_netns, &cookie);
	if (!pu)
		return FM_BIND_ALLOW;
	struct fm_pu_port key = { .port = port, .proto = FM_IPPROTO_TCP };
	struct fm_pu_owner mine = { .pu = *pu };
	/* Two tries: between a failed insert and the lookup the owner may release the port. */
	for (int i = 0; i < 2; i++) {
		if (bpf_map_update_elem(&fm_pu_ports, &key, &mine, BPF_NOEXIST) == 0) {
			fm_pu_count(0);
			return FM_BIND_ALLOW;
		}
		struct fm_pu_owner *owner = bpf_map_lookup_elem(&fm_pu_ports, &key);
		if (!owner)
			continue;
		if (owner->pu == mine.pu)
			return FM_BIND_ALLOW;
		/* Without this the refused bind fails with EPERM. */
		bpf_set_retval(-FM_EADDRINUSE);
		fm_pu_count(1);
		return FM_BIND_REFUSE;
	}
	/* Released and re-claimed twice in a row: refuse rather than let two PUs share it. */
	bpf_set_retval(-FM_EADDRINUSE);
	fm_pu_count(1);
	return FM_BIND_REFUSE;
}

SEC("cgroup/bind4")
int fm_pu_bind4(struct bpf_sock_addr *ctx)
{
	return fm_pu_bind(ctx);
}

SEC("cgroup/bind6")
int fm_pu_bind6(struct bpf_sock_addr *ctx)
{
	return fm_pu_bind(ctx);
}

char LICENSE[] SEC("license") = "GPL";
