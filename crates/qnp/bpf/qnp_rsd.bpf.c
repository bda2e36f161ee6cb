// SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0)
// Kernel receive-side dispatch for QNP (issue 5, mode 5b): an sk_reuseport program that executes
// the Matcher's RAM/CAM image (QingNiao §4.2.2, crates/qnp/src/image.rs) on the first packet of
// each request and picks the worker's socket from `qnp_workers`.
//
// The CAM is a hash map: its key is the 96-bit CAM entry (app_id, req_type, field, state, 64-bit
// string) plus the app's rule version, its value the paired 32-bit RAM word. An exact-match CAM
// lookup is a hash lookup, so the program's cost grows with the skip-and-checks a request takes,
// not with the number of rules, as in the hardware. The walk is the reference model of
// `Image::run` step for step (docs/qnp.md, "Matcher model").
//
// Follow-on packets of a request reuse the decision cached in `qnp_stash` (the paper's stash).
// Each app's entries carry a version; `qnp_epoch[app]` says which one is live, so one app's rules
// are replaced by writing the new version and flipping its epoch, without touching other apps.
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define UDP_HDR_LEN 8
#define QNP_HDR_LEN 22
#define PAYLOAD_OFF (UDP_HDR_LEN + QNP_HDR_LEN)
// Payload bytes copied from a first packet: a 1500-byte IPv4 packet carries at most 1472 bytes
// of UDP payload. The buffer is a power of two so that masked indices stay inside it.
#define MAX_PAYLOAD 1536
#define BUF_SIZE 2048
#define BUF_MASK (BUF_SIZE - 1)
#define CHECK_BYTES 8
#define MISS_BIT 0x80
// TLV fields walked to find a field (dispatch fields come first, so few are ever walked).
#define MAX_FIELDS 64
// CAM lookups per request: a well-formed image of 512 entries needs fewer than 2 * 512 + 2.
#define MAX_STEPS 1026
#define DROP 0xffffffffu
#define NO_FIELD 0x100

// Must match `CamKey` in src/kernel_rsd.rs.
struct cam_key {
    __u8 app_id;
    __u8 req_type;
    __u8 field;
    __u8 state;
    __u8 string[CHECK_BYTES];
    __u32 version;
};

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 4096);
    __type(key, struct cam_key);
    __type(value, __u32); // the RAM word: field (8) | skip (8) | check (8) | state (8)
} qnp_cam SEC(".maps");

// app_id -> the version of its live entries.
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 256);
    __type(key, __u32);
    __type(value, __u32);
} qnp_epoch SEC(".maps");

struct pkt_buf {
    __u8 data[BUF_SIZE];
};

// The first packet's payload, copied once so that the walk reads it with plain loads.
struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, struct pkt_buf);
} qnp_buf SEC(".maps");

struct stash_key {
    __u32 flow_hash;
    __u32 req_id;
};

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

// The Matcher's registers between two CAM lookups.
struct walk {
    struct cam_key key;
    __u32 plen;      // payload bytes in qnp_buf
    __u32 cur_field; // field being read, NO_FIELD before the first
    __u32 fstart;    // its value's offset in the payload
    __u32 flen;      // its value's length (0: missing, which reads as empty)
    __u32 pos;       // bytes of it consumed by earlier skip-and-checks
    __u32 result;    // the queue, or DROP
};

// Finds the first TLV with index `field`, as tlv::find_field does: a TLV that runs past the
// payload ends the walk, and an absent field reads as empty.
static void find_field(const struct pkt_buf *b, struct walk *w, __u32 field)
{
    __u32 p = 0;
    w->fstart = 0;
    w->flen = 0;
    for (int k = 0; k < MAX_FIELDS; k++) {
        if (p + 3 > w->plen)
            return;
        __u32 f = b->data[p & BUF_MASK];
        __u32 len = ((__u32)b->data[(p + 1) & BUF_MASK] << 8) | b->data[(p + 2) & BUF_MASK];
        if (p + 3 + len > w->plen)
            return;
        if (f == field) {
            w->fstart = p + 3;
            w->flen = len;
            return;
        }
        p += 3 + len;
    }
}

// One CAM lookup and the RAM entry it selects. Returns 1 when the walk is over.
static long matcher_step(__u32 index, void *ctx)
{
    struct walk *w = ctx;
    __u32 zero = 0;
    const struct pkt_buf *b = bpf_map_lookup_elem(&qnp_buf, &zero);
    if (!b) {
        w->result = DROP;
        return 1;
    }
    __u32 *ram = bpf_map_lookup_elem(&qnp_cam, &w->key);
    if (!ram) {
        if (w->key.state != 0 && !(w->key.state & MISS_BIT)) {
            // A check state missed: take its fall-through entry.
            w->key.state |= MISS_BIT;
            __builtin_memset(w->key.string, 0, CHECK_BYTES);
            return 0;
        }
        w->result = DROP;
        return 1;
    }
    __u32 word = *ram;
    __u32 field = word >> 24, skip = (word >> 16) & 0xff, check = (word >> 8) & 0xff;
    __u32 state = word & 0xff;
    if (skip == 0 && check == 0) {
        w->result = state; // an exit: the queue
        return 1;
    }
    if (w->key.state == 0 || (w->key.state & MISS_BIT) || w->cur_field != field) {
        find_field(b, w, field);
        w->cur_field = field;
        w->pos = 0;
    }
    if (check > CHECK_BYTES)
        check = CHECK_BYTES;
    w->key.field = field;
    __builtin_memset(w->key.string, 0, CHECK_BYTES);
    if (w->pos + skip + check <= w->flen) {
        __u32 at = w->fstart + w->pos + skip;
#pragma unroll
        for (int j = 0; j < CHECK_BYTES; j++)
            if ((__u32)j < check)
                w->key.string[j] = b->data[(at + j) & BUF_MASK];
        w->key.state = state;
        w->pos += skip + check;
    } else {
        w->key.state = state | MISS_BIT; // the value is too short: a mismatch
    }
    return 0;
}

SEC("sk_reuseport")
int qnp_select(struct sk_reuseport_md *md)
{
    __u8 h[QNP_HDR_LEN];
    if (bpf_skb_load_bytes(md, UDP_HDR_LEN, h, sizeof(h)))
        return SK_DROP;
    struct stash_key sk = {
        .flow_hash = md->hash,
        .req_id = ((__u32)h[2] << 24) | ((__u32)h[3] << 16) | ((__u32)h[4] << 8) | h[5],
    };
    __u32 q;
    if (h[15] != 0) {
        __u32 *cached = bpf_map_lookup_elem(&qnp_stash, &sk);
        if (!cached)
            return SK_DROP; // first packet not seen: the sender retransmits
        q = *cached;
        goto select;
    }

    __u32 zero = 0;
    struct pkt_buf *b = bpf_map_lookup_elem(&qnp_buf, &zero);
    if (!b)
        return SK_DROP;
    __u32 plen = md->len > PAYLOAD_OFF ? md->len - PAYLOAD_OFF : 0;
    if (plen > MAX_PAYLOAD)
        plen = MAX_PAYLOAD;
    if (plen > 0 && bpf_skb_load_bytes(md, PAYLOAD_OFF, b->data, plen))
        return SK_DROP;

    __u32 app = h[0];
    __u32 *epoch = bpf_map_lookup_elem(&qnp_epoch, &app);
    struct walk w = {
        .key = {.app_id = h[0], .req_type = h[1], .version = epoch ? *epoch : 0},
        .plen = plen,
        .cur_field = NO_FIELD,
        .result = DROP,
    };
    bpf_loop(MAX_STEPS, matcher_step, &w, 0);
    if (w.result == DROP)
        return SK_DROP;
    q = w.result;
    if (h[14] > 1)
        bpf_map_update_elem(&qnp_stash, &sk, &q, BPF_ANY);

select:
    if (bpf_sk_select_reuseport(md, &qnp_workers, &q, 0))
        return SK_DROP;
    return SK_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
