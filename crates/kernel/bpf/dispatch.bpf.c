/* In-kernel L7 dispatch (tier K, after "Application Layer Processing Offload in the Kernel"):
 * the sk_skb verdict (alone, or behind the stream parser) reads the first request of a connection, the HTTP/1.1
 * request line or the gRPC :method and :path in the first HTTP/2 HEADERS frame (HPACK literal
 * or static-table indexed, plain or Huffman-coded: grpc-go and h2 Huffman-code :path), and
 * picks a backend from the tier-K route table. Once the proxy's
 * slow path has opened the upstream socket and paired the two, every later byte is spliced
 * between them in the kernel. Whatever the kernel cannot decide is left to user space. */
#include "common.h"

#define FM_PATH_MAX 64
#define FM_METHOD_MAX 8
#define FM_ROUTES_MAX 64
#define FM_SCAN 256
#define FM_MAX_FRAMES 8
/* Enough iterations for a block of one-byte fields filling the scan window: the walk must
 * reach the end of the block, since a pseudo-header anywhere in it can make it malformed. */
#define FM_MAX_FIELDS FM_SCAN
/* Huffman-coded :path / :method values longer than this are left to user space. */
#define FM_HUFF_IN_MAX 96
/* Huffman-coded header names checked per block (grpc-go codes `grpc-timeout` that way);
 * a block with more falls back. */
#define FM_HNAMES 4
/* Held bytes of a frame cut across chunks: a frame header and the scan window of payload.
 * FM_HOLD is a power of two with room for a masked offset plus a masked length. */
#define FM_HOLD_MAX (9 + FM_SCAN)
#define FM_HOLD 1024
/* How long the decision waits for the first HEADERS frame: the stream offset it must start
 * at, and chunks. The proxy reads at most as much (FIRST_REQUEST_MAX in
 * crates/proxy/src/kernel.rs). */
#define FM_PENDING_MAX 16384
#define FM_PENDING_CHUNKS 64
#define FM_HUFF_EMIT 1
#define FM_HUFF_FAIL 2
#define FM_HUFF_ACCEPT 4
#define FM_NO_QUERY 0xffffffff

enum { FM_MATCH_END = 0, FM_MATCH_EXACT = 1, FM_MATCH_PREFIX = 2 };
enum { FM_ACT_BACKEND = 1, FM_ACT_PUNT = 2 };
enum { FM_L7_PENDING = 0, FM_L7_DECIDED = 1, FM_L7_FALLBACK = 2 };
enum { FM_PROTO_UNKNOWN = 0, FM_PROTO_H1 = 1, FM_PROTO_H2 = 2 };
enum {
	FM_WHY_NONE = 0,
	FM_WHY_NO_MATCH = 1,
	FM_WHY_HUFFMAN = 2,
	FM_WHY_TRUNCATED = 3,
	FM_WHY_MALFORMED = 4,
	FM_WHY_PUNT_RULE = 5,
	FM_WHY_DYNAMIC_TABLE = 6,
	FM_WHY_TOO_LONG = 7,
	FM_WHY_BUSY = 8,
	FM_WHY_PROTOCOL = 9,
	/* Not a connection's fallback but a chunk's (the connection was not the verdict's to
	 * decide): counted in their own FM_ST_WHY slot only. */
	FM_WHY_UNREGISTERED = 10, /* no state: the proxy gave the socket to the user tier */
	FM_WHY_PEER_GONE = 11,    /* spliced, but the peer left the sockhash (closed) */
	/* Not a fallback: bytes copied into fm_l7_hold (a frame cut across chunks). */
	FM_WHY_HELD = 12,
	/* The first HEADERS frame did not come within FM_PENDING_MAX bytes / FM_PENDING_CHUNKS. */
	FM_WHY_PENDING_LIMIT = 13,
	/* The path is not plain: it has a '%', "//" or a "." or ".." segment. A listener may
	 * normalise it into another route's path (flatmesh_rules::normalize); only the user tier
	 * does that, so only it decides such a request. */
	FM_WHY_NOT_PLAIN = 14,
};

/* One tier-K route, in rule order; the first entry with kind END ends the table. */
struct fm_route {
	__u8 method[FM_METHOD_MAX]; /* zero-padded; all zero matches any method */
	__u8 path[FM_PATH_MAX];
	__u32 path_len;
	__u32 kind;
	__u32 action;
	__u32 backend;
	__u32 route_id;
	__u32 protos; /* ACT_BACKEND only for these connection protocols: 1 << FM_PROTO_* */
};

/* Per-connection state, keyed by socket cookie; written by the proxy, advanced here. */
struct fm_l7_conn {
	__u64 peer;       /* cookie of the socket to splice to; 0 while not paired */
	__u64 stream_pos; /* bytes of this stream the verdict has seen before pairing */
	__u64 next_frame; /* HTTP/2: stream offset of the next frame header */
	__u64 spliced;    /* bytes redirected to the peer since pairing */
	__u32 state;
	__u32 proto;
	__u32 backend;
	__u32 route_id;
	__u32 reason; /* FM_WHY_* when state is FALLBACK */
	__u32 chunks; /* chunks the verdict has seen while the decision was pending */
};

/* Part of a frame cut across chunks while the decision is pending (a frame header, or the
 * first HEADERS frame: header and up to FM_SCAN bytes of payload), from stream offset `at`.
 * The chunks themselves go up to user space as usual; these are copies. */
struct fm_l7_hold {
	__u8 buf[FM_HOLD];
	__u64 at;
	__u32 len;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u64);
	__type(value, struct fm_l7_hold);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_l7_hold SEC(".maps");

struct fm_scratch {
	__u8 buf[FM_SCAN * 2];
	__u8 path[FM_PATH_MAX];
	__u8 method[FM_METHOD_MAX];
	__u32 path_len; /* may exceed FM_PATH_MAX: then only prefixes can match */
	__u32 busy;
	/* bpf_loop state lives here, not on the stack: map values are not tracked precisely,
	 * so the verifier checks each callback once instead of once per distinct position. */
	__u32 pos, end, have_path, have_method, why, regular, seen, pseudo; /* HTTP/2 header-block walk */
	__u32 n, sp1, sp2, crlf, bad;                /* HTTP/1.1 request-line scan */
	/* Whether the path is plain (fm_plain_step): bytes of the current segment (capped at 3),
	 * whether they are all dots, a '/' seen, the query reached, and the verdict. */
	__u32 seg, dots, slash, inq, notplain;
	__u32 hit;                                   /* route match */
	/* Huffman-coded :path / :method found by the field walk, decoded after it. */
	__u32 hp_pos, hp_len, hp_huff, hm_pos, hm_len, hm_huff;
	/* Huffman decode state: input at buf[hpos..hpos+hlen] into path or method. */
	__u32 hpos, hlen, hfield, hstate, hout, hacc, hbad, hlong, hq;
	/* Huffman-coded regular header names found by the field walk, checked after it. */
	__u32 hn_n, hn_pos[FM_HNAMES], hn_len[FM_HNAMES];
	/* A new fm_l7_hold entry is built here (too large for the stack). */
	struct fm_l7_hold hold;
};

/* The HPACK Huffman code as a nibble automaton (src/huffman.rs builds it): entry
 * state * 16 + nibble = next state | symbol << 8 | FM_HUFF_* << 16. */
struct fm_huff_table {
	__u32 e[256 * 16];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fm_huff_table);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_huffman SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, __u32); /* socket fd on update */
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_l7_socks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, struct fm_l7_conn);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_l7_conns SEC(".maps");

/* port -> 1: the node's http listeners whose connections the verdict decides. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 64);
	__type(key, __u16);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_l7_ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, FM_ROUTES_MAX);
	__type(key, __u32);
	__type(value, struct fm_route);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fm_routes SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fm_scratch);
} fm_scratch SEC(".maps");

static const char fm_h2_preface[24] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

static __always_inline void fm_fallback(struct fm_l7_conn *c, __u32 why)
{
	c->state = FM_L7_FALLBACK;
	c->reason = why;
	fm_count(FM_ST_VERDICT, 0, 0, 0, 1);
	fm_count(FM_ST_WHY + (why & (FM_WHY_SLOTS - 1)), 0, 0, 0, 1);
}

static long fm_match_one(__u32 i, void *unused)
{
	__u32 zero = 0;
	struct fm_route *r = bpf_map_lookup_elem(&fm_routes, &i);
	struct fm_scratch *s = bpf_map_lookup_elem(&fm_scratch, &zero);
	if (!r || !s || r->kind == FM_MATCH_END)
		return 1;
	if (r->method[0]) {
		for (int j = 0; j < FM_METHOD_MAX; j++)
			if (r->method[j] != s->method[j])
				return 0;
	}
	__u32 rlen = r->path_len;
	if (rlen > FM_PATH_MAX)
		return 0;
	if (r->kind == FM_MATCH_EXACT && rlen != s->path_len)
		return 0;
	if (rlen > s->path_len)
		return 0;
	for (int j = 0; j < FM_PATH_MAX; j++) {
		if (j >= rlen)
			break;
		if (r->path[j] != s->path[j])
			return 0;
	}
	s->hit = i;
	return 1;
}

/* One byte of a path (before its '?') through the plain-path check: a '%', an empty
 * segment ("//") or a "." or ".." segment ends with s->notplain set. Mirrors
 * flatmesh_rules::normalize::is_plain, which the lowering's reference executor runs. */
static __always_inline void fm_plain_step(struct fm_scratch *s, __u8 ch)
{
	if (ch == '%') {
		s->notplain = 1;
	} else if (ch == '/') {
		if (s->slash && (s->seg == 0 || (s->dots && s->seg <= 2)))
			s->notplain = 1;
		s->slash = 1;
		s->seg = 0;
		s->dots = 1;
	} else if (s->slash) {
		if (s->seg < 3)
			s->seg++;
		if (ch != '.')
			s->dots = 0;
	}
}

/* The path has ended: a last segment of "." or ".." is not plain either. */
static __always_inline void fm_plain_end(struct fm_scratch *s)
{
	if (s->slash && s->dots && (s->seg == 1 || s->seg == 2))
		s->notplain = 1;
}

static __always_inline void fm_plain_reset(struct fm_scratch *s)
{
	s->seg = 0;
	s->dots = 0;
	s->slash = 0;
	s->inq = 0;
	s->notplain = 0;
}

/* One byte of s->path per bpf_loop iteration (HTTP/2: the whole path is there). The loop
 * runs at most FM_PATH_MAX times; the mask below is what the verifier needs (a separate
 * `i < FM_PATH_MAX` test lets clang drop it). */
static long fm_plain_byte(__u32 i, void *unused)
{
	__u32 zero = 0;
	struct fm_scratch *s = bpf_map_lookup_elem(&fm_scratch, &zero);
	if (!s || i >= s->path_len)
		return 1;
	fm_plain_step(s, s->path[i & (FM_PATH_MAX - 1)]);
	return 0;
}

/* Runs the route table over s->method / s->path, first match wins as in the user tier. */
static __always_inline void fm_route(struct fm_scratch *s, struct fm_l7_conn *c)
{
	if (s->notplain) {
		fm_fallback(c, FM_WHY_NOT_PLAIN);
		return;
	}
	s->hit = FM_ROUTES_MAX;
	bpf_loop(FM_ROUTES_MAX, fm_match_one, NULL, 0);
	__u32 hit = s->hit;
	struct fm_route *r = bpf_map_lookup_elem(&fm_routes, &hit);
	if (!r) {
		fm_fallback(c, FM_WHY_NO_MATCH);
		return;
	}
	if (r->action != FM_ACT_BACKEND) {
		c->route_id = r->route_id;
		fm_fallback(c, FM_WHY_PUNT_RULE);
		return;
	}
	/* A spliced connection reaches the backend as the client speaks it. */
	if (!(r->protos & (1u << (c->proto & 31)))) {
		c->route_id = r->route_id;
		fm_fallback(c, FM_WHY_PROTOCOL);
		return;
	}
	c->state = FM_L7_DECIDED;
	c->backend = r->backend;
	c->route_id = r->route_id;
	fm_count(FM_ST_VERDICT, 0, 0, 1, 0);
}

/* Copies a path (stopping at '?') of `len` bytes at buf[pos] into s->path. */
static __always_inline void fm_take_path(struct fm_scratch *s, __u32 pos, __u32 len)
{
	__u32 plen = len;
	for (int j = 0; j < FM_PATH_MAX; j++) {
		if (j >= len)
			break;
		__u8 ch = s->buf[(pos + j) & (FM_SCAN * 2 - 1)];
		if (ch == '?') {
			plen = j;
			break;
		}
		s->path[j] = ch;
	}
	/* A longer path with its '?' beyond the copied bytes: exact rules cannot match it and
	 * prefix rules only look at the first FM_PATH_MAX bytes, so its full length is enough. */
	s->path_len = plen;
}

/* One byte of the request line per bpf_loop iteration (state in struct fm_scratch). */
static long fm_h1_byte(__u32 i, void *unused)
{
	__u32 zero = 0;
	struct fm_scratch *s = bpf_map_lookup_elem(&fm_scratch, &zero);
	if (!s || i >= s->n)
		return 1;
	__u8 ch = s->buf[i & (FM_SCAN * 2 - 1)];
	if (ch == ' ') {
		if (!s->sp1) {
			s->sp1 = i;
		} else if (!s->sp2) {
			s->sp2 = i;
			if (!s->inq)
				fm_plain_end(s);
		}
	} else if (ch == '\r' || ch == '\n') {
		s->crlf = i;
		return 1;
	} else if (ch < 0x21 || ch > 0x7e) {
		/* Not a valid request-line byte: the user tier would reject it, so must we. */
		s->bad = 1;
	} else if (s->sp1 && !s->sp2 && !s->inq) {
		/* A byte of the request target's path: the whole of it is checked, not only the
		 * FM_PATH_MAX bytes a prefix entry compares. */
		if (ch == '?') {
			s->inq = 1;
			fm_plain_end(s);
		} else {
			fm_plain_step(s, ch);
		}
	}
	return 0;
}

/* HTTP/1.1: "METHOD SP request-target SP HTTP/1.x CRLF" within the first FM_SCAN bytes. */
static __always_inline void fm_h1(struct fm_scratch *s, __u32 n, struct fm_l7_conn *c)
{
	s->n = n;
	s->sp1 = 0;
	s->sp2 = 0;
	s->crlf = 0;
	s->bad = 0;
	fm_plain_reset(s);
	bpf_loop(FM_SCAN, fm_h1_byte, NULL, 0);
	__u32 sp1 = s->sp1, sp2 = s->sp2, crlf = s->crlf;
	if (!crlf) {
		fm_fallback(c, n >= FM_SCAN ? FM_WHY_TOO_LONG : FM_WHY_TRUNCATED);
		return;
	}
	/* Exactly "METHOD SP target SP HTTP/1.x" up to the line end, nothing looser. */
	if (s->bad || !sp1 || !sp2 || sp2 <= sp1 + 1 || sp1 > FM_METHOD_MAX || sp2 + 9 != crlf ||
	    crlf > FM_SCAN) {
		fm_fallback(c, FM_WHY_MALFORMED);
		return;
	}
	const char version[7] = "HTTP/1.";
	for (int i = 0; i < 7; i++) {
		if (s->buf[(sp2 + 1 + i) & (FM_SCAN * 2 - 1)] != version[i]) {
			fm_fallback(c, FM_WHY_MALFORMED);
			return;
		}
	}
	__u8 minor = s->buf[(sp2 + 8) & (FM_SCAN * 2 - 1)];
	if (minor != '0' && minor != '1') {
		fm_fallback(c, FM_WHY_MALFORMED);
		return;
	}
	for (int i = 0; i < FM_METHOD_MAX; i++) {
		if (i >= sp1)
			break;
		__u8 ch = s->buf[i];
		if (ch < 'A' || ch > 'Z') {
			fm_fallback(c, FM_WHY_MALFORMED);
			return;
		}
		s->method[i] = ch;
	}
	/* An absolute-form or '*' target is left to the user tier, which knows what it means. */
	if (s->buf[(sp1 + 1) & (FM_SCAN * 2 - 1)] != '/') {
		fm_fallback(c, FM_WHY_MALFORMED);
		return;
	}
	fm_take_path(s, sp1 + 1, sp2 - sp1 - 1);
	fm_route(s, c);
}

enum { FM_FIELD_OTHER = 0, FM_FIELD_METHOD = 1, FM_FIELD_PATH = 2, FM_FIELD_NAME = 7 };

/* A character of a header name as HTTP/2 allows it: a token character, not upper case
 * (RFC 9110 5.6.2, RFC 9113 8.2.1). */
static __always_inline int fm_name_char(__u8 ch)
{
	if ((ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9'))
		return 1;
	switch (ch) {
	case '!': case '#': case '$': case '%': case '&': case '\'': case '*': case '+':
	case '-': case '.': case '^': case '_': case '`': case '|': case '~':
		return 1;
	}
	return 0;
}

/* One nibble of a Huffman-coded value per bpf_loop iteration (state in struct fm_scratch). */
static long fm_huff_nibble(__u32 i, void *unused)
{
	__u32 zero = 0;
	struct fm_scratch *s = bpf_map_lookup_elem(&fm_scratch, &zero);
	struct fm_huff_table *t = bpf_map_lookup_elem(&fm_huffman, &zero);
	if (!s || !t || i >= s->hlen * 2)
		return 1;
	__u8 b = s->buf[(s->hpos + (i >> 1)) & (FM_SCAN * 2 - 1)];
	__u32 nib = (i & 1) ? (b & 0xf) : (b >> 4);
	__u32 e = t->e[(((s->hstate & 0xff) << 4) | nib) & (256 * 16 - 1)];
	__u32 flags = e >> 16;
	if (flags & FM_HUFF_FAIL) {
		s->hbad = 1;
		return 1;
	}
	if (flags & FM_HUFF_EMIT) {
		__u8 ch = (e >> 8) & 0xff;
		__u32 n = s->hout;
		if (s->hfield == FM_FIELD_PATH) {
			/* Only paths whose every byte the kernel has checked are decided here. */
			if (ch < 0x21 || ch > 0x7e) {
				s->hbad = 1;
				return 1;
			}
			if (n >= FM_PATH_MAX) {
				s->hlong = 1;
				return 1;
			}
			s->path[n & (FM_PATH_MAX - 1)] = ch;
			if (ch == '?' && s->hq == FM_NO_QUERY)
				s->hq = n;
		} else if (s->hfield == FM_FIELD_NAME) {
			/* A regular header name: checked, not kept. */
			if (!fm_name_char(ch)) {
				s->hbad = 1;
				return 1;
			}
		} else {
			if (ch < 'A' || ch > 'Z' || n >= FM_METHOD_MAX) {
				s->hbad = 1;
				return 1;
			}
			s->method[n & (FM_METHOD_MAX - 1)] = ch;
		}
		s->hout = n + 1;
	}
	s->hstate = e & 0xff;
	s->hacc = (flags & FM_HUFF_ACCEPT) != 0;
	return 0;
}

/* Decodes the Huffman string at buf[pos..pos+len] into s->path or s->method; returns an
 * FM_WHY_* reason, or 0 when it decoded cleanly. */
static __always_inline __u32 fm_huff_decode(struct fm_scratch *s, __u32 pos, __u32 len, __u32 field)
{
	if (len > FM_HUFF_IN_MAX)
		return FM_WHY_TOO_LONG;
	s->hpos = pos;
	s->hlen = len;
	s->hfield = field;
	s->hstate = 0;
	s->hout = 0;
	s->hacc = 1;
	s->hbad = 0;
	s->hlong = 0;
	s->hq = FM_NO_QUERY;
	bpf_loop(FM_HUFF_IN_MAX * 2, fm_huff_nibble, NULL, 0);
	if (s->hlong)
		return FM_WHY_TOO_LONG;
	if (s->hbad || !s->hacc || s->hout == 0)
		return FM_WHY_MALFORMED;
	if (field == FM_FIELD_PATH) {
		if (s->path[0] != '/')
			return FM_WHY_MALFORMED;
		s->path_len = s->hq == FM_NO_QUERY ? s->hout : s->hq;
	}
	return 0;
}

/* Reads an HPACK integer with an N-bit prefix at buf[*pos]. One continuation byte at most
 * (values up to prefix max + 127): enough for static-table indexes and for strings that fit
 * the scan window; anything larger ends the walk, which then falls back. No inner loop, so the
 * verifier does not multiply states per field. */
static __always_inline int fm_hpack_int(struct fm_scratch *s, __u32 *pos, __u32 end, __u8 mask,
					__u32 *out)
{
	__u32 p = *pos;
	if (p >= end)
		return -1;
	__u32 v = s->buf[p & (FM_SCAN * 2 - 1)] & mask;
	p++;
	if (v == mask) {
		if (p >= end)
			return -1;
		__u8 b = s->buf[p & (FM_SCAN * 2 - 1)];
		p++;
		if (b & 0x80)
			return -1;
		v += b;
	}
	*pos = p;
	*out = v;
	return 0;
}

enum { FM_NAME_AUTHORITY = 3, FM_NAME_REGULAR = 4, FM_NAME_BAD = 5, FM_NAME_SCHEME = 6 };

/* What a static-table name index names in a request. */
static __always_inline int fm_static_name(__u32 idx)
{
	if (idx == 2 || idx == 3)
		return FM_FIELD_METHOD;
	if (idx == 4 || idx == 5)
		return FM_FIELD_PATH;
	if (idx == 1)
		return FM_NAME_AUTHORITY;
	if (idx == 6 || idx == 7)
		return FM_NAME_SCHEME;
	if (idx >= 8 && idx <= 14)
		return FM_NAME_BAD; /* :status has no place in a request */
	return FM_NAME_REGULAR;
}

/* RFC 9113 8.3: pseudo-header fields come before the regular ones, each at most once, and
 * only the request ones (:method, :scheme, :authority, :path) belong in a request. A block
 * that breaks that is malformed: the user tier refuses it, so the kernel must not decide it.
 * The walk covers the whole block (fm_h2_block decides nothing otherwise), so a violation
 * after :method and :path is seen too. Returns nonzero (with w->why set) to stop the walk. */
static __always_inline int fm_field_order(struct fm_scratch *w, int kind)
{
	w->seen = 1;
	if (kind == FM_NAME_BAD) {
		w->why = FM_WHY_MALFORMED;
		return 1;
	}
	if (kind == FM_NAME_REGULAR) {
		w->regular = 1;
		return 0;
	}
	__u32 bit = 1u << (kind & 7);
	if (w->regular || (w->pseudo & bit)) {
		w->why = FM_WHY_MALFORMED;
		return 1;
	}
	w->pseudo |= bit;
	return 0;
}

/* One header field per bpf_loop iteration; the walk state is in the scratch map (s->pos ..). */
static long fm_h2_field(__u32 unused, void *unused_ctx)
{
	__u32 zero = 0;
	struct fm_scratch *s = bpf_map_lookup_elem(&fm_scratch, &zero);
	if (!s)
		return 1;
	struct fm_scratch *w = s;
	__u32 pos = w->pos, end = w->end;
	if (end > FM_SCAN)
		end = FM_SCAN;
	if (pos >= end)
		return 1;
	__u8 b = s->buf[pos & (FM_SCAN * 2 - 1)];
	__u32 idx = 0;
	if (b & 0x80) {
		/* Indexed field: only static entries exist in a connection's first block. */
		if (fm_hpack_int(s, &pos, end, 0x7f, &idx) < 0)
			return 1;
		w->pos = pos;
		if (idx > 61) {
			w->why = FM_WHY_DYNAMIC_TABLE;
			return 1;
		}
		if (idx == 0) {
			w->why = FM_WHY_MALFORMED; /* index 0 is not a table entry */
			return 1;
		}
		if (fm_field_order(w, fm_static_name(idx)))
			return 1;
		if (idx == 2 || idx == 3) {
			s->method[0] = idx == 2 ? 'G' : 'P';
			s->method[1] = idx == 2 ? 'E' : 'O';
			s->method[2] = idx == 2 ? 'T' : 'S';
			s->method[3] = idx == 2 ? 0 : 'T';
			w->have_method = 1;
		} else if (idx == 4) {
			s->path[0] = '/';
			s->path_len = 1;
			w->have_path = 1;
		} else if (idx == 5) {
			w->why = FM_WHY_TOO_LONG; /* "/index.html" from the static table: rare */
			return 1;
		}
		return 0;
	}
	if ((b & 0xe0) == 0x20) {
		/* Dynamic table size update: only at the start of a block (RFC 7541 4.2). */
		if (w->seen) {
			w->why = FM_WHY_MALFORMED;
			return 1;
		}
		if (fm_hpack_int(s, &pos, end, 0x1f, &idx) < 0)
			return 1;
		w->pos = pos;
		return 0;
	}
	__u8 mask = (b & 0xc0) == 0x40 ? 0x3f : 0x0f;
	if (fm_hpack_int(s, &pos, end, mask, &idx) < 0)
		return 1;
	int field = FM_FIELD_OTHER;
	if (idx > 61) {
		w->why = FM_WHY_DYNAMIC_TABLE;
		return 1;
	} else if (idx == 0) {
		/* Literal name. */
		if (pos >= end)
			return 1;
		int huff = s->buf[pos & (FM_SCAN * 2 - 1)] & 0x80;
		__u32 nlen = 0;
		if (fm_hpack_int(s, &pos, end, 0x7f, &nlen) < 0)
			return 1;
		if (nlen > FM_SCAN || pos + nlen > end)
			return 1;
		if (huff) {
			/* A Huffman-coded name (grpc-go codes `grpc-timeout` so). The walk only needs
			 * to know whether it is a pseudo-header, and every pseudo-header name starts with
			 * ':', whose code is the 7 bits 1011100 (RFC 7541 Appendix B): the code is
			 * prefix-free, so the first 7 bits tell. A coded pseudo-header name (no encoder
			 * sends one: they are all in the static table) is left to user space; a regular
			 * name is decoded and checked after the walk. */
			__u32 k = w->hn_n;
			if (nlen == 0) {
				w->why = FM_WHY_MALFORMED;
				return 1;
			}
			if ((s->buf[pos & (FM_SCAN * 2 - 1)] & 0xfe) == 0xb8 || nlen > FM_HUFF_IN_MAX ||
			    k >= FM_HNAMES) {
				w->why = FM_WHY_HUFFMAN;
				return 1;
			}
			w->hn_pos[k & (FM_HNAMES - 1)] = pos;
			w->hn_len[k & (FM_HNAMES - 1)] = nlen;
			w->hn_n = k + 1;
			field = FM_NAME_REGULAR;
			pos += nlen;
			goto value;
		}
		__u8 c0 = s->buf[pos & (FM_SCAN * 2 - 1)];
		__u8 c1 = s->buf[(pos + 1) & (FM_SCAN * 2 - 1)];
		__u8 c2 = s->buf[(pos + 2) & (FM_SCAN * 2 - 1)];
		__u8 c3 = s->buf[(pos + 3) & (FM_SCAN * 2 - 1)];
		__u8 c4 = s->buf[(pos + 4) & (FM_SCAN * 2 - 1)];
		__u8 c5 = s->buf[(pos + 5) & (FM_SCAN * 2 - 1)];
		__u8 c6 = s->buf[(pos + 6) & (FM_SCAN * 2 - 1)];
		__u8 c7 = s->buf[(pos + 7) & (FM_SCAN * 2 - 1)];
		__u8 c8 = s->buf[(pos + 8) & (FM_SCAN * 2 - 1)];
		__u8 c9 = s->buf[(pos + 9) & (FM_SCAN * 2 - 1)];
		if (nlen == 5 && c0 == ':' && c1 == 'p' && c2 == 'a' && c3 == 't' && c4 == 'h')
			field = FM_FIELD_PATH;
		else if (nlen == 7 && c0 == ':' && c1 == 'm' && c2 == 'e' && c3 == 't' && c4 == 'h' &&
			 c5 == 'o' && c6 == 'd')
			field = FM_FIELD_METHOD;
		else if (nlen == 7 && c0 == ':' && c1 == 's' && c2 == 'c' && c3 == 'h' && c4 == 'e' &&
			 c5 == 'm' && c6 == 'e')
			field = FM_NAME_SCHEME;
		else if (nlen == 10 && c0 == ':' && c1 == 'a' && c2 == 'u' && c3 == 't' && c4 == 'h' &&
			 c5 == 'o' && c6 == 'r' && c7 == 'i' && c8 == 't' && c9 == 'y')
			field = FM_NAME_AUTHORITY;
		else /* any other pseudo-header (:status, :protocol, unknown) is not for the kernel */
			field = nlen > 0 && c0 == ':' ? FM_NAME_BAD : FM_NAME_REGULAR;
		pos += nlen;
	} else {
		field = fm_static_name(idx);
	}
value:
	if (fm_field_order(w, field))
		return 1;
	if (field != FM_FIELD_METHOD && field != FM_FIELD_PATH)
		field = FM_FIELD_OTHER;
	if (pos >= end)
		return 1;
	int vhuff = s->buf[pos & (FM_SCAN * 2 - 1)] & 0x80;
	__u32 vlen = 0;
	if (fm_hpack_int(s, &pos, end, 0x7f, &vlen) < 0)
		return 1;
	if (vlen > FM_SCAN || (pos + vlen > end && field != FM_FIELD_OTHER)) {
		w->pos = pos + vlen; /* past the end: malformed when the block is whole */
		return 1;
	}
	if (field != FM_FIELD_OTHER && vhuff) {
		/* Decoded after the walk (no bpf_loop inside a bpf_loop callback). */
		if (field == FM_FIELD_PATH) {
			w->hp_pos = pos;
			w->hp_len = vlen;
			w->hp_huff = 1;
			w->have_path = 1;
		} else {
			w->hm_pos = pos;
			w->hm_len = vlen;
			w->hm_huff = 1;
			w->have_method = 1;
		}
	} else if (field == FM_FIELD_PATH) {
		if (vlen == 0 || s->buf[pos & (FM_SCAN * 2 - 1)] != '/') {
			w->why = FM_WHY_MALFORMED;
			return 1;
		}
		/* Only paths whose every byte the kernel has checked are decided here. */
		if (vlen > FM_PATH_MAX) {
			w->why = FM_WHY_TOO_LONG;
			return 1;
		}
		for (int i = 0; i < FM_PATH_MAX; i++) {
			if (i >= vlen)
				break;
			__u8 ch = s->buf[(pos + i) & (FM_SCAN * 2 - 1)];
			if (ch < 0x21 || ch > 0x7e) {
				w->why = FM_WHY_MALFORMED;
				return 1;
			}
		}
		fm_take_path(s, pos, vlen);
		w->have_path = 1;
	} else if (field == FM_FIELD_METHOD) {
		if (vlen == 0 || vlen > FM_METHOD_MAX) {
			w->why = FM_WHY_MALFORMED;
			return 1;
		}
		for (int i = 0; i < FM_METHOD_MAX; i++) {
			if (i >= vlen)
				break;
			__u8 ch = s->buf[(pos + i) & (FM_SCAN * 2 - 1)];
			if (ch < 'A' || ch > 'Z') {
				w->why = FM_WHY_MALFORMED;
				return 1;
			}
			s->method[i] = ch;
		}
		w->have_method = 1;
	}
	w->pos = pos + vlen;
	return 0;
}

/* Walks the header block of the first HEADERS frame (s->buf[pos..end]). `partial` is 0 when
 * buf[pos..end] is the whole block, else the FM_WHY_* reason it is not (the rest is in a later
 * chunk, a CONTINUATION frame, or past the scan window). */
static __always_inline void fm_h2_block(__u32 pos, __u32 end, __u32 partial, struct fm_l7_conn *c)
{
	__u32 zero = 0;
	struct fm_scratch *s = bpf_map_lookup_elem(&fm_scratch, &zero);
	if (!s)
		return;
	s->pos = pos;
	s->end = end;
	s->have_path = 0;
	s->have_method = 0;
	s->why = 0;
	s->regular = 0;
	s->seen = 0;
	s->pseudo = 0;
	s->hp_huff = 0;
	s->hm_huff = 0;
	s->hn_n = 0;
	bpf_loop(FM_MAX_FIELDS, fm_h2_field, NULL, 0);
	if (s->why) {
		fm_fallback(c, s->why);
		return;
	}
	/* Only a block checked to its end is decided: what the kernel has not read could still
	 * make the request malformed (a repeated or late pseudo-header). */
	if (partial) {
		fm_fallback(c, partial);
		return;
	}
	if (s->pos != end) {
		/* A field running past the block is malformed; a walk that stopped short (an
		 * integer too large for the kernel's reader) is simply not decided here. */
		fm_fallback(c, s->pos > end ? FM_WHY_MALFORMED : FM_WHY_TOO_LONG);
		return;
	}
	if (s->have_path && s->have_method) {
		__u32 why = 0;
		if (s->hm_huff)
			why = fm_huff_decode(s, s->hm_pos, s->hm_len, FM_FIELD_METHOD);
		if (!why && s->hp_huff)
			why = fm_huff_decode(s, s->hp_pos, s->hp_len, FM_FIELD_PATH);
		for (int i = 0; i < FM_HNAMES && !why; i++) {
			if (i >= s->hn_n)
				break;
			/* An invalid code or a character no header name has: the user tier's
			 * HPACK decoder refuses the block. */
			why = fm_huff_decode(s, s->hn_pos[i], s->hn_len[i], FM_FIELD_NAME);
		}
		if (why) {
			fm_fallback(c, why);
			return;
		}
		/* RFC 9113 8.3.1: a request other than CONNECT carries :scheme; CONNECT carries
		 * neither :scheme nor :path. The user tier refuses both as malformed. */
		if (!(s->pseudo & (1u << FM_NAME_SCHEME)) ||
		    (s->method[0] == 'C' && s->method[1] == 'O' && s->method[2] == 'N' &&
		     s->method[3] == 'N' && s->method[4] == 'E' && s->method[5] == 'C' &&
		     s->method[6] == 'T' && s->method[7] == 0)) {
			fm_fallback(c, FM_WHY_MALFORMED);
			return;
		}
		/* The whole path (at most FM_PATH_MAX bytes here) is in s->path. */
		fm_plain_reset(s);
		bpf_loop(FM_PATH_MAX, fm_plain_byte, NULL, 0);
		fm_plain_end(s);
		fm_route(s, c);
		return;
	}
	fm_fallback(c, FM_WHY_MALFORMED);
}

/* Parses the first HEADERS frame's payload, whose first `avail` bytes (of `flen`) are in
 * s->buf: padding and priority fields, then the header block. `partial` is 0 when the
 * payload is whole, else the FM_WHY_* reason it is not. */
static __always_inline void fm_h2_headers(struct fm_scratch *s, struct fm_l7_conn *c, __u8 flags,
					  __u32 avail, __u32 partial)
{
	if (!(flags & 0x4) && !partial)
		partial = FM_WHY_TOO_LONG; /* the block goes on in CONTINUATION frames */
	if (avail == 0) {
		fm_fallback(c, FM_WHY_MALFORMED);
		return;
	}
	/* Padding length and priority fields come before the header block. */
	__u32 pos = 0, end = avail, pad = 0;
	if (flags & 0x8) {
		pad = s->buf[0];
		pos = 1;
	}
	if (flags & 0x20)
		pos += 5;
	if (!partial) {
		if (pad + pos > end) {
			fm_fallback(c, FM_WHY_MALFORMED); /* more padding than frame */
			return;
		}
		end -= pad;
	}
	if (pos >= end) {
		fm_fallback(c, FM_WHY_MALFORMED);
		return;
	}
	fm_h2_block(pos, end, partial, c);
}

/* Starts holding the frame at c->next_frame, of which this chunk has the bytes from `off` to
 * its end (fewer than that frame needs: a header cut short, or a HEADERS payload that goes on).
 * They stay in fm_l7_hold until the next chunks complete them; the chunk itself goes up to
 * user space as usual. */
static __always_inline void fm_hold_start(struct __sk_buff *skb, struct fm_scratch *s,
					  struct fm_l7_conn *c, __u64 cookie, __u32 off)
{
	__u32 n = skb->len - off;
	if (n == 0 || n > FM_HOLD_MAX) {
		fm_fallback(c, FM_WHY_TRUNCATED);
		return;
	}
	s->hold.at = c->next_frame;
	s->hold.len = n;
	if (bpf_skb_load_bytes(skb, off, s->hold.buf, ((n - 1) & (FM_HOLD / 2 - 1)) + 1) < 0 ||
	    bpf_map_update_elem(&fm_l7_hold, &cookie, &s->hold, BPF_ANY)) {
		/* No room to hold it (the map is LRU, so this is rare): user space decides. */
		fm_fallback(c, FM_WHY_TRUNCATED);
		return;
	}
	fm_count(FM_ST_WHY + FM_WHY_HELD, 1, n, 0, 0);
}

/* Bytes of the first HEADERS payload the kernel needs: the whole payload, or the scan window
 * of a larger one (which then falls back as TooLong unless its first part is malformed). */
static __always_inline __u32 fm_need(__u32 flen)
{
	return flen > FM_SCAN ? FM_SCAN : flen;
}

/* A frame begun in an earlier chunk is held: adds this chunk's bytes (up to what the frame
 * can need) and finishes it if it is now complete. Returns how many bytes of this chunk it
 * took (the frames after it are walked as usual), or -1 when the decision is made or must
 * wait for a later chunk. */
static __always_inline int fm_hold_continue(struct __sk_buff *skb, struct fm_scratch *s,
					    struct fm_l7_conn *c, struct fm_l7_hold *h)
{
	__u32 len = skb->len;
	__u32 have = h->len;
	if (h->at != c->next_frame || have == 0 || have >= FM_HOLD_MAX) {
		fm_fallback(c, FM_WHY_MALFORMED);
		return -1;
	}
	__u32 take = FM_HOLD_MAX - have;
	if (take > len)
		take = len;
	if (take == 0)
		return -1;
	if (bpf_skb_load_bytes(skb, 0, &h->buf[have & (FM_HOLD / 2 - 1)],
			       ((take - 1) & (FM_HOLD / 2 - 1)) + 1) < 0) {
		fm_fallback(c, FM_WHY_TRUNCATED);
		return -1;
	}
	have += take;
	h->len = have;
	fm_count(FM_ST_WHY + FM_WHY_HELD, 0, take, 0, 0);
	if (have < 9)
		return -1; /* the frame header is still incomplete */
	__u32 flen = ((__u32)h->buf[0] << 16) | ((__u32)h->buf[1] << 8) | h->buf[2];
	__u8 type = h->buf[3], flags = h->buf[4];
	if (type == 9) { /* CONTINUATION before any HEADERS: not a valid stream */
		fm_fallback(c, FM_WHY_MALFORMED);
		return -1;
	}
	if (type != 1) {
		/* Another frame: only its header was needed. The frames after it start in this
		 * chunk, at a known offset from c->next_frame; walk them as usual. */
		__u32 used = 9 - (have - take);
		c->next_frame += 9 + (__u64)flen;
		return used;
	}
	__u32 need = fm_need(flen);
	if (have < 9 + need)
		return -1; /* more of the HEADERS payload to come */
	/* The whole block (or the scan window) is held: parse it from there. */
	__builtin_memcpy(s->buf, &h->buf[9], FM_SCAN);
	fm_h2_headers(s, c, flags, need, flen > FM_SCAN ? FM_WHY_TOO_LONG : 0);
	return -1;
}

/* HTTP/2: skip frames (SETTINGS, WINDOW_UPDATE, ...) up to the first HEADERS frame, which may
 * arrive in a later chunk than the preface, and may itself be cut across chunks (a frame
 * header or payload that goes on in the next chunk is held in fm_l7_hold until it is whole). */
static __always_inline void fm_h2(struct __sk_buff *skb, struct fm_scratch *s, struct fm_l7_conn *c,
				  __u64 cookie)
{
	__u32 len = skb->len;
	__u64 base = c->stream_pos;
	struct fm_l7_hold *h = bpf_map_lookup_elem(&fm_l7_hold, &cookie);
	if (h) {
		int used = fm_hold_continue(skb, s, c, h);
		if (used < 0)
			return;
		/* The held frame was not HEADERS: drop it and go on from its end. */
		bpf_map_delete_elem(&fm_l7_hold, &cookie);
	}
	__u32 off = 0, flen = 0;
	__u8 flags = 0;
	int found = 0;
	for (int i = 0; i < FM_MAX_FRAMES; i++) {
		if (c->next_frame < base) {
			fm_fallback(c, FM_WHY_MALFORMED);
			return;
		}
		/* The first HEADERS frame must start within FM_PENDING_MAX bytes of the stream. */
		if (c->next_frame > FM_PENDING_MAX) {
			fm_fallback(c, FM_WHY_PENDING_LIMIT);
			return;
		}
		__u64 off64 = c->next_frame - base;
		if (off64 >= len)
			return; /* the next frame starts in a later chunk */
		off = off64;
		__u8 hdr[9];
		if (off + 9 > len) {
			fm_hold_start(skb, s, c, cookie, off);
			return;
		}
		if (bpf_skb_load_bytes(skb, off, hdr, 9) < 0) {
			fm_fallback(c, FM_WHY_TRUNCATED);
			return;
		}
		flen = ((__u32)hdr[0] << 16) | ((__u32)hdr[1] << 8) | hdr[2];
		flags = hdr[4];
		if (hdr[3] == 1) {
			found = 1;
			break;
		}
		if (hdr[3] == 9) { /* CONTINUATION before any HEADERS: not a valid stream */
			fm_fallback(c, FM_WHY_MALFORMED);
			return;
		}
		c->next_frame += 9 + (__u64)flen;
	}
	if (!found) {
		fm_fallback(c, FM_WHY_TOO_LONG);
		return;
	}
	__u32 start = off + 9;
	__u32 avail = len > start ? len - start : 0;
	__u32 need = fm_need(flen);
	if (avail < need) {
		fm_hold_start(skb, s, c, cookie, off);
		return;
	}
	if (need > 0 &&
	    bpf_skb_load_bytes(skb, start, s->buf, ((need - 1) & (FM_SCAN - 1)) + 1) < 0) {
		fm_fallback(c, FM_WHY_TRUNCATED);
		return;
	}
	fm_h2_headers(s, c, flags, need, flen > FM_SCAN ? FM_WHY_TOO_LONG : 0);
}

static __always_inline void fm_decide(struct __sk_buff *skb, struct fm_l7_conn *c, __u64 cookie)
{
	__u32 zero = 0;
	struct fm_scratch *s = bpf_map_lookup_elem(&fm_scratch, &zero);
	if (!s)
		return;
	/* The scratch buffer is per CPU; a nested run on the same CPU must not share it. */
	if (s->busy) {
		fm_fallback(c, FM_WHY_BUSY);
		return;
	}
	s->busy = 1;
	__builtin_memset(s->path, 0, sizeof(s->path));
	__builtin_memset(s->method, 0, sizeof(s->method));
	s->path_len = 0;
	fm_plain_reset(s);
	__u32 len = skb->len;
	/* Bounded wait for the first HEADERS frame (HTTP/1.1 is decided on the first chunk): a
	 * client that sends that many chunks of other frames first is left to the user tier;
	 * fm_h2 bounds the bytes. */
	c->chunks++;
	if (c->proto == FM_PROTO_H2 && c->chunks > FM_PENDING_CHUNKS) {
		fm_fallback(c, FM_WHY_PENDING_LIMIT);
		goto out;
	}
	if (c->proto == FM_PROTO_UNKNOWN) {
		if (c->stream_pos != 0 || len == 0) {
			fm_fallback(c, FM_WHY_MALFORMED);
			goto out;
		}
		__u32 n = len > FM_SCAN ? FM_SCAN : len;
		if (bpf_skb_load_bytes(skb, 0, s->buf, ((n - 1) & (FM_SCAN - 1)) + 1) < 0) {
			fm_fallback(c, FM_WHY_TRUNCATED);
			goto out;
		}
		int h2 = n >= 24;
		for (int i = 0; i < 24 && h2; i++)
			if (s->buf[i] != fm_h2_preface[i])
				h2 = 0;
		if (!h2) {
			c->proto = FM_PROTO_H1;
			fm_h1(s, n, c);
			goto out;
		}
		c->proto = FM_PROTO_H2;
		c->next_frame = 24;
	}
	if (c->proto == FM_PROTO_H2)
		fm_h2(skb, s, c, cookie);
	else
		fm_fallback(c, FM_WHY_MALFORMED);
out:
	/* Decided or left to user space: nothing more to hold. */
	if (c->state != FM_L7_PENDING)
		bpf_map_delete_elem(&fm_l7_hold, &cookie);
	s->busy = 0;
}

/* Registers a connection accepted on an L7 listener port the moment it is established,
 * before any payload can arrive. A client that sends its request right after connect()
 * (the usual case) would otherwise have it queued before the proxy could register the
 * socket from accept(), and the verdict would never see the first request. */
SEC("sockops")
int fm_sockops_l7(struct bpf_sock_ops *skops)
{
	if (skops->op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB || !fm_own_netns(skops))
		return 1;
	__u16 port = (__u16)skops->local_port;
	if (!bpf_map_lookup_elem(&fm_l7_ports, &port))
		return 1;
	__u64 cookie = bpf_get_socket_cookie(skops);
	struct fm_l7_conn fresh = {};
	/* State first: the verdict ignores sockets it has no state for. */
	if (bpf_map_update_elem(&fm_l7_conns, &cookie, &fresh, BPF_ANY)) {
		fm_count(FM_ST_SOCKOPS_L7, 1, 0, 0, 1);
		return 1;
	}
	long err = bpf_sock_hash_update(skops, &fm_l7_socks, &cookie, BPF_NOEXIST);
	if (err)
		bpf_map_delete_elem(&fm_l7_conns, &cookie);
	fm_count(FM_ST_SOCKOPS_L7, 1, 0, err == 0, err != 0);
	return 1;
}

SEC("sk_skb/stream_parser")
int fm_parser(struct __sk_buff *skb)
{
	/* Every chunk is one message: the verdict keeps the stream position itself. */
	fm_count(FM_ST_PARSER, 1, 0, 0, 0);
	return skb->len;
}

SEC("sk_skb/stream_verdict")
int fm_verdict(struct __sk_buff *skb)
{
	__u64 cookie = bpf_get_socket_cookie(skb);
	struct fm_l7_conn *c = bpf_map_lookup_elem(&fm_l7_conns, &cookie);
	__u32 len = skb->len;
	if (len == 0) {
		/* Without a stream parser the verdict also sees the FIN, as an empty skb
		 * (tcp_read_skb). TCP has recorded the FIN already (the socket reads EOF), so the skb
		 * carries nothing: drop it, and the proxy carries the half-close itself, after the
		 * spliced bytes. Redirected, the peer's psock backlog would fail to send zero bytes
		 * and set EPIPE on the peer; passed, it can queue behind bytes redirected to this
		 * socket and, taken in the backlog as a zero-byte ingress, set EPIPE here and stop
		 * this socket's transmit, dropping the peer's later bytes (sk_psock_backlog). Nor is
		 * it a first request to decide. */
		fm_count(FM_ST_VERDICT, 1, 0, 0, 0);
		return FM_SK_DROP;
	}
	if (!c) {
		/* Not a decision: the socket's bytes are the user tier's (or were never ours). */
		fm_count(FM_ST_VERDICT, 1, 0, 0, 0);
		fm_count(FM_ST_WHY + FM_WHY_UNREGISTERED, 0, len, 0, 1);
		return FM_SK_PASS;
	}
	__u64 peer = c->peer;
	if (peer) {
		if (bpf_sk_redirect_hash(skb, &fm_l7_socks, &peer, 0) == FM_SK_PASS) {
			/* What the proxy never sees, for its byte counts. */
			c->spliced += len;
			fm_count(FM_ST_VERDICT, 1, len, 0, 0);
			return FM_SK_PASS;
		}
		/* The peer closed: hand the bytes to the proxy, which tears the pair down. */
		fm_count(FM_ST_VERDICT, 1, 0, 0, 0);
		fm_count(FM_ST_WHY + FM_WHY_PEER_GONE, 0, len, 0, 1);
		return FM_SK_PASS;
	}
	fm_count(FM_ST_VERDICT, 1, 0, 0, 0);
	if (c->state == FM_L7_PENDING)
		fm_decide(skb, c, cookie);
	c->stream_pos += len;
	return FM_SK_PASS;
}
