//! Tier N: every http listener's routes lowered to one QingNiao Matcher image
//! ([`crate::image`], file format `QNPIMG01`, [`TABLE_ENTRIES`] entries), so that a NIC could
//! dispatch each HTTP/1.x request to the core that serves its route (QingNiao §3.3, §4.2).
//!
//! The contract (docs/rules.md, "Tier N"):
//! - listener *i* (config order, from 0) is app_id *i*+1, req_type 0; field 0 is the request
//!   line up to its first CR (`GET /api/x?y=1 HTTP/1.1`);
//! - the queue is the route's index + 1 where the image decides the route, and 0 ("hand to the
//!   host") where it does not, including "no route matches": every listener's app has default 0;
//! - a route whose match is at most a method and an exact or prefix path of up to 64 bytes
//!   that starts with `/`, with any action (cluster, split or direct response: the host runs the
//!   action of the route the queue names), is decided while the image has room.
//!
//! A route becomes rules of the form `METHOD SP path-pattern`:
//! - exact path `e`: `M e ` and `M e?` (the query is not part of the path, as in the user tier);
//! - prefix `p`: `M p`; no path (or the empty prefix): `M /`. Every deciding rule thus starts
//!   with `M /`, so an absolute-form (`GET http://...`) or `OPTIONS *` request line never
//!   matches one and goes to the host;
//! - no method: one rule per method of the listener's method set ([`COMMON_METHODS`] and every
//!   method a route names). A request with any other method matches no rule: host.
//!
//! A route the image cannot decide is lowered to rules of the same shape with queue 0 whose
//! match is a superset of the route's (its host, header and query conditions dropped, a regex
//! cut to its literal prefix, a long path to 64 bytes, anything else to every path), so first
//! match order holds: a request that route could take never reaches a later route's rule.
//! Rules of different methods never match the same request line, so the image holds them
//! grouped by method (route order within a method), which lets `GET /api/a` and `GET /api/b`
//! share states. Routes are added in order while the listener's rules fit (the 512 entries are
//! shared by every listener, and one app has 127 check states); the first route that does not
//! fit ends the listener's lowering, and it and every later route go to the host by the default.

use std::ops::Range;

use crate::image::{compile_app, Image, MAX_STATES, TABLE_ENTRIES};
use crate::lower::{Lowering, Verdict};
use crate::matcher::PathCond;
use crate::normalize::PathNormalization;
use crate::program::{CompiledRoute, ListenerTable, TableKind};
use crate::reason::Reason;
use crate::skipcheck::{Decision, PatByte, Rule};
use crate::tier::Tier;
use crate::{ListenerId, Request, RouteId};

/// Path bytes a deciding rule may compare.
pub const PATH_MAX: usize = 64;
/// The request type of every http request.
pub const REQ_TYPE: u8 = 0;
/// The field the rules read: the request line up to its first CR.
pub const FIELD: u8 = 0;
/// The queue that hands a request to the host.
pub const HOST_QUEUE: u8 = 0;
/// Methods a route without a method is decided for, besides those other routes name.
pub const COMMON_METHODS: [&str; 7] = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"];
/// The last listener index with an app id (app ids are 8 bits, 0 is not used).
const MAX_LISTENER: usize = u8::MAX as usize - 1;
/// The last route index with a queue (queues are 8 bits, 0 is the host).
const MAX_ROUTE: usize = u8::MAX as usize - 1;

/// Tier N's lowering of a program: the image and what it means for every http route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicLowering {
    pub image: Image,
    /// One per listener of the program, by listener id.
    pub listeners: Vec<NicListener>,
}

/// One listener in the image.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NicListener {
    /// The app id its requests carry; `None`: not in the image (a tcp listener, or no app id
    /// left).
    pub app_id: Option<u8>,
    /// Its entries in the image (its app's start entry, rules and default).
    pub entries: Range<usize>,
    /// The rules its routes were lowered to, in route order (queue 0: hand to the host). The
    /// image holds them grouped by method (see `by_method`), which matches the same requests.
    pub rules: Vec<Rule>,
    /// One per route, by route id.
    pub routes: Vec<NicRoute>,
}

/// One route in the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicRoute {
    pub verdict: Verdict,
    /// Its rules, as a range of [`NicListener::rules`] (empty when it got none).
    pub rules: Range<usize>,
}

impl NicRoute {
    /// The queue the image sends the route's requests to, if it decides the route.
    pub fn queue(&self, route: RouteId) -> Option<u8> {
        self.verdict
            .decides()
            .then(|| u8::try_from(route + 1).ok())
            .flatten()
    }
}

/// Whether the image could decide `route` of a listener that normalises paths as `paths`
/// does, if it had room.
///
/// The image compares the request line's bytes as received, so where the listener normalises
/// paths it decides exact paths only: a request matching `M /x ` has the path `/x`, which is
/// the path the user tier matches too, whereas `M /api` would also take `/api/../admin`,
/// which the user tier matches as `/admin`.
pub fn check(route: &CompiledRoute, paths: PathNormalization) -> Result<(), Reason> {
    let m = &route.matches;
    if m.host.is_some() {
        return Err(Reason::HostMatch);
    }
    if !m.headers.is_empty() {
        return Err(Reason::HeaderMatch);
    }
    if !m.query.is_empty() {
        return Err(Reason::QueryMatch);
    }
    if m.grpc_field.is_some() {
        return Err(Reason::GrpcFieldMatch);
    }
    match &m.path {
        None => Ok(()),
        Some(PathCond::Regex(_)) => Err(Reason::RegexPath),
        Some(PathCond::Exact(p) | PathCond::Prefix(p)) => {
            if p.bytes().any(|b| matches!(b, b'?' | b' ' | b'\r' | b'\n')) {
                Err(Reason::PathNeverMatches)
            } else if p.len() > PATH_MAX {
                Err(Reason::PathTooLong { max: PATH_MAX })
            } else if !p.is_empty() && !p.starts_with('/') {
                Err(Reason::PathNotOrigin)
            } else {
                Ok(())
            }
        }
    }
    .and_then(|()| normalized(route, paths))
}

/// The part of [`check`] about the listener's path normalisation.
fn normalized(route: &CompiledRoute, paths: PathNormalization) -> Result<(), Reason> {
    if paths.is_raw() {
        return Ok(());
    }
    match &route.matches.path {
        Some(PathCond::Exact(e)) if paths.is_normal(e) => Ok(()),
        Some(PathCond::Exact(_)) => Err(Reason::PathNotNormal),
        _ => Err(Reason::PathNormalized),
    }
}

/// Whether no request the user tier sees can match the route's path, so that it needs no
/// rule at all.
fn never_matches(route: &CompiledRoute, paths: PathNormalization) -> bool {
    matches!(
        check(route, paths),
        Err(Reason::PathNeverMatches | Reason::PathNotNormal)
    )
}

/// The request-target patterns (after `METHOD SP`) of a route: exact ones when `decides`, else
/// a superset of every origin-form target the route could match.
fn targets(route: &CompiledRoute, decides: bool) -> Vec<Vec<u8>> {
    let origin = |p: &[u8]| p.first() == Some(&b'/');
    let cut = |p: &[u8]| p[..p.len().min(PATH_MAX)].to_vec();
    match &route.matches.path {
        None => vec![if decides { b"/".to_vec() } else { Vec::new() }],
        Some(PathCond::Prefix(p)) if p.is_empty() => {
            vec![if decides { b"/".to_vec() } else { Vec::new() }]
        }
        Some(PathCond::Exact(e)) if decides || e.len() <= PATH_MAX && origin(e.as_bytes()) => {
            vec![format!("{e} ").into_bytes(), format!("{e}?").into_bytes()]
        }
        Some(PathCond::Exact(p) | PathCond::Prefix(p)) if origin(p.as_bytes()) => {
            vec![cut(p.as_bytes())]
        }
        Some(PathCond::Regex(r)) => {
            let guard = r.guard();
            vec![if origin(&guard) {
                cut(&guard)
            } else {
                Vec::new()
            }]
        }
        Some(PathCond::Exact(_) | PathCond::Prefix(_)) => vec![Vec::new()],
    }
}

/// The methods a route without a method is lowered for: [`COMMON_METHODS`] and every method
/// the listener's routes name, shortest first so that rules of one shape sit together and
/// share the image's states.
fn method_set(routes: &[CompiledRoute]) -> Vec<String> {
    let mut set: Vec<String> = COMMON_METHODS
        .iter()
        .map(|m| m.to_string())
        .chain(
            routes
                .iter()
                .filter_map(|r| r.matches.method.as_ref().map(|m| m.as_str().to_owned())),
        )
        .collect();
    set.sort_by(|a, b| (a.len(), a).cmp(&(b.len(), b)));
    set.dedup();
    set
}

/// The rules of one route.
fn route_rules(
    app_id: u8,
    route: &CompiledRoute,
    paths: PathNormalization,
    methods: &[String],
    queue: u8,
) -> Vec<Rule> {
    // The user tier never picks the route, so no request needs a rule.
    if never_matches(route, paths) {
        return Vec::new();
    }
    let decides = queue != HOST_QUEUE;
    let targets = targets(route, decides);
    let own;
    let methods = match &route.matches.method {
        Some(m) => {
            own = [m.as_str().to_owned()];
            &own[..]
        }
        None => methods,
    };
    let mut rules = Vec::with_capacity(methods.len() * targets.len());
    for m in methods {
        for t in &targets {
            rules.push(Rule {
                app_id,
                req_type: REQ_TYPE,
                field: FIELD,
                pattern: PatByte::literal(m.as_bytes())
                    .chain([PatByte::Byte(b' ')])
                    .chain(PatByte::literal(t))
                    .collect(),
                queue,
                line: route.id,
            });
        }
    }
    rules
}

/// Whether every request line `new` matches, `old` matches too (so `new`, coming later, is
/// never reached).
fn covers(old: &Rule, new: &Rule) -> bool {
    old.pattern.len() <= new.pattern.len()
        && old
            .pattern
            .iter()
            .zip(&new.pattern)
            .all(|(o, n)| *o == PatByte::Skip || o == n)
}

/// The rules in the order the image holds them: grouped by method, in route order within a
/// method. Rules of different methods never match the same request line (a method has no
/// space, and every rule has one right after its method), so only the order within a method
/// is first-match order; grouping lets rules that share their leading bytes (`GET /api/`)
/// share the image's states and entries.
fn by_method(rules: &[Rule]) -> Vec<&Rule> {
    let method = |r: &Rule| -> Vec<u8> {
        r.pattern
            .iter()
            .map_while(|p| match p {
                PatByte::Byte(b' ') | PatByte::Skip => None,
                PatByte::Byte(b) => Some(*b),
            })
            .collect()
    };
    let mut sorted: Vec<&Rule> = rules.iter().collect();
    sorted.sort_by_cached_key(|r| method(r));
    sorted
}

/// Lowers one http listener into at most `budget` entries.
fn lower_listener(
    app_id: u8,
    routes: &[CompiledRoute],
    paths: PathNormalization,
    budget: usize,
) -> (NicListener, Image) {
    let methods = method_set(routes);
    let mut out = NicListener {
        app_id: Some(app_id),
        ..NicListener::default()
    };
    // With no rules, the app is its start entry: the default, queue 0.
    let mut entries = compile_app(app_id, REQ_TYPE, &[], Some(HOST_QUEUE)).unwrap_or_default();
    for (i, r) in routes.iter().enumerate() {
        let checked = check(r, paths);
        let stop = if i > MAX_ROUTE {
            Some(Reason::QueueRange {
                max_route: MAX_ROUTE,
            })
        } else {
            let queue = if checked.is_ok() {
                i as u8 + 1
            } else {
                HOST_QUEUE
            };
            let start = out.rules.len();
            let mut own = route_rules(app_id, r, paths, &methods, queue);
            let had_rules = !own.is_empty();
            // A rule an earlier rule covers is never reached: leave it out.
            let mut shadowed_by = None;
            own.retain(|new| match out.rules.iter().find(|old| covers(old, new)) {
                Some(old) => {
                    shadowed_by.get_or_insert(old.line);
                    false
                }
                None => true,
            });
            out.rules.extend(own);
            match compile_app(app_id, REQ_TYPE, &by_method(&out.rules), Some(HOST_QUEUE)) {
                Ok(e) if e.len() <= budget => {
                    entries = e;
                    let verdict = match (checked, shadowed_by) {
                        (Err(why), _) => Verdict::Host(why),
                        (Ok(()), Some(by)) if had_rules && out.rules.len() == start => {
                            Verdict::Host(Reason::Shadowed { by })
                        }
                        (Ok(()), _) => Verdict::Decides,
                    };
                    out.routes.push(NicRoute {
                        verdict,
                        rules: start..out.rules.len(),
                    });
                    None
                }
                Ok(_) => {
                    out.rules.truncate(start);
                    Some(Reason::ImageFull {
                        entries: TABLE_ENTRIES,
                    })
                }
                // compile_app fails only when the app needs more check states than it has.
                Err(_) => {
                    out.rules.truncate(start);
                    Some(Reason::ImageStates { max: MAX_STATES })
                }
            }
        };
        if let Some(why) = stop {
            let end = out.rules.len();
            out.routes.extend(routes[i..].iter().map(|r| NicRoute {
                verdict: Verdict::host(check(r, paths), why),
                rules: end..end,
            }));
            break;
        }
    }
    let mut image = Image::default();
    image.push(entries);
    (out, image)
}

impl NicLowering {
    /// Lowers every http listener, in order, into one image.
    pub(crate) fn lower(listeners: &[ListenerTable]) -> NicLowering {
        let mut out = NicLowering {
            image: Image::default(),
            listeners: Vec::with_capacity(listeners.len()),
        };
        let in_image = |id: usize, l: &ListenerTable| {
            id <= MAX_LISTENER
                && !l.tls
                && l.authz.is_none()
                && matches!(l.kind, TableKind::Http(_))
        };
        for (id, l) in listeners.iter().enumerate() {
            let TableKind::Http(t) = &l.kind else {
                out.listeners.push(NicListener::default());
                continue;
            };
            if !in_image(id, l) {
                let why = if l.tls {
                    Reason::ListenerTls
                } else if l.authz.is_some() {
                    Reason::Authorization
                } else {
                    Reason::AppIdRange {
                        max_listener: MAX_LISTENER,
                    }
                };
                out.listeners.push(NicListener {
                    routes: t
                        .routes
                        .iter()
                        .map(|r| NicRoute {
                            // TLS and policies keep the whole listener out, whatever
                            // the route; the app id range only routes it could have held.
                            verdict: if matches!(why, Reason::ListenerTls | Reason::Authorization) {
                                Verdict::Host(why)
                            } else {
                                Verdict::host(check(r, t.paths), why)
                            },
                            rules: 0..0,
                        })
                        .collect(),
                    ..NicListener::default()
                });
                continue;
            }
            // Keep one entry (the default) for every later listener in the image.
            let later = listeners
                .iter()
                .enumerate()
                .skip(id + 1)
                .filter(|(i, l)| in_image(*i, l))
                .count();
            let budget = TABLE_ENTRIES.saturating_sub(out.image.cam.len() + later);
            // id <= MAX_LISTENER, so id + 1 fits in u8.
            let (mut listener, image) = lower_listener(id as u8 + 1, &t.routes, t.paths, budget);
            let start = out.image.cam.len();
            listener.entries = start..start + image.cam.len();
            out.image.cam.extend(image.cam);
            out.image.ram.extend(image.ram);
            out.listeners.push(listener);
        }
        out
    }

    /// Every rule of every listener, in image order (the image is compiled from them).
    pub fn rules(&self) -> impl Iterator<Item = &Rule> {
        self.listeners.iter().flat_map(|l| l.rules.iter())
    }

    /// The request line the image reads as field 0, for the reference executor:
    /// `METHOD SP path[?query] SP HTTP/1.1`.
    pub fn request_line(req: &Request<'_>) -> Vec<u8> {
        let mut line = Vec::with_capacity(req.path.len() + 32);
        line.extend_from_slice(req.method.as_str().as_bytes());
        line.push(b' ');
        line.extend_from_slice(req.path.as_bytes());
        if let Some(q) = req.query {
            line.push(b'?');
            line.extend_from_slice(q.as_bytes());
        }
        line.extend_from_slice(b" HTTP/1.1");
        line
    }

    /// What the image decides for a request line on `listener`: `Some(route)` for queue
    /// route + 1, `None` for the host (queue 0, or an app the image does not hold).
    pub fn decide_line(&self, listener: ListenerId, line: &[u8]) -> Option<RouteId> {
        let app = self.listeners.get(listener)?.app_id?;
        let line = line.split(|b| *b == b'\r').next().unwrap_or_default();
        match self
            .image
            .run(app, REQ_TYPE, |f| (f == FIELD).then_some(line))
            .0
        {
            Decision::Queue(q) => usize::from(q).checked_sub(1),
            Decision::Drop => None,
        }
    }
}

impl Lowering for NicLowering {
    fn tier(&self) -> Tier {
        Tier::Nic
    }

    fn verdict(&self, listener: ListenerId, route: RouteId) -> Option<Verdict> {
        Some(self.listeners.get(listener)?.routes.get(route)?.verdict)
    }

    /// Runs the image with the bit-exact Matcher model on the request's request line.
    fn decide(&self, listener: ListenerId, req: &Request<'_>) -> Option<RouteId> {
        self.decide_line(listener, &Self::request_line(req))
    }
}
