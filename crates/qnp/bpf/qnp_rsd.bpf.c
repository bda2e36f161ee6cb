// SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0)
// Kernel receive-side dispatch for QNP (issue 5, mode 5b): an sk_reuseport program that reads the
// QNP header (Fig. 11) and the first TLV field of each packet, matches the skip-and-check rules that
// flatmesh-qnp lowered into `qnp_rules`, and picks the worker's socket from `qnp_workers`.
// Follow-on packets of a request reuse the decision cached in `qnp_stash` (the paper's stash).
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define QNP_HDR_LEN 22
#define UDP_HDR_LEN 8
#define MAX_RULES 64
#define MAX_PAT 16

// Must match `KernelRule` in src/kernel_rsd.rs.
struct qnp_rule {
    __u8 app_id;
    __u8 req_type;
    __u8 field;
    __u8 len;   // pattern length: the value must be at least this long
    __u8 queue;
    __u8 pad[3];
    __u8 bytes[MAX_PAT];
    __u8 mask[MAX_PAT]; // 0xff where the byte is checked, 0 where it is skipped
};

struct stash_key {
    __u32 flow_hash;
    __u32 req_id;
};

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, MAX_RULES);
    __type(key, __u32);
    __type(value, struct qnp_rule);
} qnp_rules SEC(".maps");

// Entry 0: the number of valid rules.
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, __u32);
} qnp_nrules SEC(".maps");

// (app_id << 8 | req_type) -> default queue.
struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 1024);
    __type(key, __u32);
    __type(value, __u32);
} qnp_defaults SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_LRU_HASH);
    __uint(max_entries, 4096);
    __type(key, struct stash_key);
    __type(value, __u32);
} qnp_stash SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_REUSEPORT_SOCKARRAY);
    __uint(max_entries, 64);
    __type(key, __u32);
    __type(value, __u32);
} qnp_workers SEC(".maps");

SEC("sk_reuseport")
int qnp_select(struct sk_reuseport_md *md)
{
    __u8 h[QNP_HDR_LEN];
    if (bpf_skb_load_bytes(md, UDP_HDR_LEN, h, sizeof(h)))
        return SK_DROP;
    __u8 app = h[0], type = h[1];
    struct stash_key sk = {
        .flow_hash = md->hash,
        .req_id = ((__u32)h[2] << 24) | ((__u32)h[3] << 16) | ((__u32)h[4] << 8) | h[5],
    };
    __u32 q = 0;
    if (h[15] != 0) {
        __u32 *cached = bpf_map_lookup_elem(&qnp_stash, &sk);
        if (!cached)
            return SK_DROP; // first packet not seen: the sender retransmits
        q = *cached;
        goto select;
    }

    // The first TLV: type, big-endian length, value (up to MAX_PAT bytes read).
    __u8 tl[3] = {0xff, 0, 0};
    __u8 val[MAX_PAT] = {};
    __u32 vlen = 0;
    __u32 off = UDP_HDR_LEN + QNP_HDR_LEN;
    if (bpf_skb_load_bytes(md, off, tl, 3) == 0) {
        vlen = ((__u32)tl[1] << 8) | tl[2];
        __u32 avail = md->len > off + 3 ? md->len - off - 3 : 0;
        if (vlen > avail)
            vlen = avail;
#pragma unroll
        for (int j = 0; j < MAX_PAT; j++) {
            if ((__u32)j < vlen)
                bpf_skb_load_bytes(md, off + 3 + j, &val[j], 1);
        }
    }

    __u32 zero = 0;
    __u32 *np = bpf_map_lookup_elem(&qnp_nrules, &zero);
    __u32 n = np ? *np : 0;
    int found = 0;
    for (__u32 i = 0; i < MAX_RULES; i++) {
        if (i >= n)
            break;
        __u32 key = i;
        struct qnp_rule *r = bpf_map_lookup_elem(&qnp_rules, &key);
        if (!r)
            break;
        if (r->app_id != app || r->req_type != type)
            continue;
        // Only the first TLV is read; a rule on another field sees an empty value.
        __u32 have = r->field == tl[0] ? vlen : 0;
        if (r->len > have)
            continue;
        __u8 diff = 0;
#pragma unroll
        for (int j = 0; j < MAX_PAT; j++)
            diff |= (val[j] ^ r->bytes[j]) & r->mask[j];
        if (diff == 0) {
            q = r->queue;
            found = 1;
            break;
        }
    }
    if (!found) {
        __u32 dkey = ((__u32)app << 8) | type;
        __u32 *d = bpf_map_lookup_elem(&qnp_defaults, &dkey);
        if (!d)
            return SK_DROP;
        q = *d;
    }
    if (h[14] > 1)
        bpf_map_update_elem(&qnp_stash, &sk, &q, BPF_ANY);

select:
    if (bpf_sk_select_reuseport(md, &qnp_workers, &q, 0))
        return SK_DROP;
    return SK_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
