//! Authorization between the config model and Envoy's API, both ways: a listener's
//! `authorization` is Envoy RBAC, the HTTP filter `envoy.filters.http.rbac` before the router on
//! `http` listeners and the network filter `envoy.filters.network.rbac` before tcp_proxy on
//! `tcp` listeners (docs/security.md, "Authorization over xDS and Envoy import").
//!
//! Envoy's RBAC config has one action, flatmesh's policies have one each, so a listener's
//! policies become two layers: a DENY RBAC with the `deny` policies, then an ALLOW RBAC with the
//! `allow` policies, which is written only when the listener has an `allow` policy or
//! `default: deny` (an ALLOW RBAC without policies denies everything). Each layer can only
//! refuse, so a request passes both exactly when flatmesh's order admits it.
//!
//! One policy is one RBAC policy named like it: `principals` is `[any]` or one `and_ids` of
//! `or_ids` (the principals, the namespaces), `permissions` is `[any]` or one `and_rules` of
//! `or_rules` (methods, paths, hosts, then one per `when`). Reading accepts that shape, a part
//! without its `or_*` wrapper, and a top-level list of one kind; anything else is an error that
//! names the field, so an Envoy policy never turns into a flatmesh policy that checks less.

use std::collections::HashMap;
use std::mem::take;

use envoy_types::pb::envoy::config::listener::v3::{filter, Filter};
use envoy_types::pb::envoy::config::rbac::v3::{
    permission, principal, rbac, Permission, Policy, Principal, Rbac as Rules,
};
use envoy_types::pb::envoy::config::route::v3::{header_matcher, HeaderMatcher};
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::Rbac as HttpRbac;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpFilter,
};
use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac as NetworkRbac;
use envoy_types::pb::envoy::r#type::matcher::v3::{
    path_matcher, string_matcher, PathMatcher, RegexMatcher, StringMatcher,
};
use envoy_types::pb::google::protobuf::Any;
use flatmesh_config as model;
use prost::{Message, Name};

use crate::error::{Result, XdsError};
use crate::to_model::{reject_rest, unpack};

pub const HTTP_RBAC_NAME: &str = "envoy.filters.http.rbac";
pub const NETWORK_RBAC_NAME: &str = "envoy.filters.network.rbac";

/// A namespace is matched on the caller's SPIFFE ID with this regex around the escaped name:
/// any trust domain, then `/ns/NAME`, then nothing or `/...`, exactly the IDs whose `ns/NAME`
/// segment flatmesh reads (Envoy's safe_regex must match the whole ID). A prefix cannot say
/// "any trust domain".
const NS_HEAD: &str = "spiffe://[^/]*/ns/";
const NS_TAIL: &str = "(/.*)?";
/// A path pattern `*` (any path): Envoy's path matchers have no "any", and a prefix cannot be
/// empty.
const ANY_PATH: &str = ".*";
const METHOD: &str = ":method";
const AUTHORITY: &str = ":authority";

// ---- model -> Envoy ----

/// The RBAC layers of `authz`, in the order they must run: deny, then allow.
fn layers(authz: &model::Authorization) -> Vec<Rules> {
    let of = |action: model::AuthzAction| -> HashMap<String, Policy> {
        authz
            .policies
            .iter()
            .filter(|p| p.action == action)
            .map(|p| (p.name.clone(), policy(p)))
            .collect()
    };
    let deny = of(model::AuthzAction::Deny);
    let allow = of(model::AuthzAction::Allow);
    let mut out = Vec::new();
    if !deny.is_empty() {
        out.push(Rules {
            action: rbac::Action::Deny as i32,
            policies: deny,
            ..Default::default()
        });
    }
    if !allow.is_empty() || authz.default == model::AuthzDefault::Deny {
        out.push(Rules {
            action: rbac::Action::Allow as i32,
            policies: allow,
            ..Default::default()
        });
    }
    out
}

/// An `http` listener's authorization as HTTP filters, to go before the router.
pub fn http_filters(authz: &model::Authorization) -> Vec<HttpFilter> {
    layers(authz)
        .into_iter()
        .map(|rules| HttpFilter {
            name: HTTP_RBAC_NAME.into(),
            config_type: Some(http_filter::ConfigType::TypedConfig(pack_with_rules(
                &HttpRbac::default(),
                &rules,
            ))),
            ..Default::default()
        })
        .collect()
}

/// A `tcp` listener's authorization as network filters, to go before tcp_proxy. Envoy decides
/// on the connection's first byte; flatmesh on accepting it (the same decision: only the
/// caller's certificate counts).
pub fn network_filters(authz: &model::Authorization, stat_prefix: &str) -> Vec<Filter> {
    layers(authz)
        .into_iter()
        .map(|rules| Filter {
            name: NETWORK_RBAC_NAME.into(),
            config_type: Some(filter::ConfigType::TypedConfig(pack_with_rules(
                &NetworkRbac {
                    stat_prefix: stat_prefix.into(),
                    ..Default::default()
                },
                &rules,
            ))),
        })
        .collect()
}

/// An RBAC filter config (`filter`, without `rules`; both filters have `rules` as field 1,
/// and `rules` has only its action besides the policies)
/// packed with `rules`, whose policies are written in name order. prost writes a map in its
/// hasher's order, which changes from one map to the next, and the server's versions are
/// hashes of these bytes: the same policies must always give the same bytes, or every rebuild
/// would push every listener again.
pub(crate) fn pack_with_rules<M: Message + Name>(filter: &M, rules: &Rules) -> Any {
    let mut encoded_rules = Rules {
        policies: HashMap::new(),
        ..rules.clone()
    }
    .encode_to_vec();
    let mut named: Vec<(&String, &Policy)> = rules.policies.iter().collect();
    named.sort_by(|a, b| a.0.cmp(b.0));
    for (name, policy) in named {
        // A map entry is a message with the key as field 1 and the value as field 2; the
        // map is field 2 of `Rules`.
        let mut entry = Vec::new();
        prost::encoding::string::encode(1, name, &mut entry);
        prost::encoding::message::encode(2, policy, &mut entry);
        prost::encoding::bytes::encode(2, &entry, &mut encoded_rules);
    }
    // Fields in tag order, as prost writes them: `rules` first.
    let mut value = Vec::new();
    prost::encoding::bytes::encode(1, &encoded_rules, &mut value);
    value.extend(filter.encode_to_vec());
    Any {
        type_url: M::type_url(),
        value,
    }
}

fn policy(p: &model::AuthzPolicy) -> Policy {
    let from = p.from.clone().unwrap_or_default();
    let mut ids = Vec::new();
    if !from.principals.is_empty() {
        ids.push(or_ids(
            from.principals
                .iter()
                .map(|id| crate::tls::spiffe_matcher(id))
                .collect(),
        ));
    }
    if !from.namespaces.is_empty() {
        ids.push(or_ids(
            from.namespaces
                .iter()
                .map(|ns| namespace_matcher(ns))
                .collect(),
        ));
    }
    let to = p.to.clone().unwrap_or_default();
    let mut rules = Vec::new();
    if !to.methods.is_empty() {
        rules.push(or_rules(
            to.methods
                .iter()
                .map(|m| header_rule(METHOD, Some(exact(m, false))))
                .collect(),
        ));
    }
    if !to.paths.is_empty() {
        rules.push(or_rules(to.paths.iter().map(|p| path_rule(p)).collect()));
    }
    if !to.hosts.is_empty() {
        // flatmesh compares hosts without case (and without the port: the HTTP connection
        // manager strips it).
        rules.push(or_rules(
            to.hosts
                .iter()
                .map(|h| header_rule(AUTHORITY, pattern(h, true)))
                .collect(),
        ));
    }
    for w in &p.when {
        rules.push(or_rules(
            w.values
                .iter()
                .map(|v| header_rule(&w.header, pattern(v, false)))
                .collect(),
        ));
    }
    Policy {
        principals: vec![Principal {
            identifier: Some(if ids.is_empty() {
                principal::Identifier::Any(true)
            } else {
                principal::Identifier::AndIds(principal::Set { ids })
            }),
        }],
        permissions: vec![Permission {
            rule: Some(if rules.is_empty() {
                permission::Rule::Any(true)
            } else {
                permission::Rule::AndRules(permission::Set { rules })
            }),
        }],
        ..Default::default()
    }
}

fn or_ids(names: Vec<StringMatcher>) -> Principal {
    let ids = names
        .into_iter()
        .map(|m| Principal {
            identifier: Some(principal::Identifier::Authenticated(
                principal::Authenticated {
                    principal_name: Some(m),
                },
            )),
        })
        .collect();
    Principal {
        identifier: Some(principal::Identifier::OrIds(principal::Set { ids })),
    }
}

fn or_rules(rules: Vec<Permission>) -> Permission {
    Permission {
        rule: Some(permission::Rule::OrRules(permission::Set { rules })),
    }
}

fn namespace_matcher(ns: &str) -> StringMatcher {
    StringMatcher {
        match_pattern: Some(string_matcher::MatchPattern::SafeRegex(RegexMatcher {
            regex: format!("{NS_HEAD}{}{NS_TAIL}", regex_escape(ns)),
            ..Default::default()
        })),
        ignore_case: false,
    }
}

/// Backslash before every character RE2 gives a meaning to.
fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if r"\.+*?()|[]{}^$-#&~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn exact(text: &str, ignore_case: bool) -> StringMatcher {
    StringMatcher {
        match_pattern: Some(string_matcher::MatchPattern::Exact(text.into())),
        ignore_case,
    }
}

/// A flatmesh pattern (exact, `prefix*`, `*suffix`) as a string matcher; `None` for `*`.
fn pattern(text: &str, ignore_case: bool) -> Option<StringMatcher> {
    let match_pattern = if text == "*" {
        return None;
    } else if let Some(prefix) = text.strip_suffix('*') {
        string_matcher::MatchPattern::Prefix(prefix.into())
    } else if let Some(suffix) = text.strip_prefix('*') {
        string_matcher::MatchPattern::Suffix(suffix.into())
    } else {
        string_matcher::MatchPattern::Exact(text.into())
    };
    Some(StringMatcher {
        match_pattern: Some(match_pattern),
        ignore_case,
    })
}

/// A header condition; without a matcher, the header's presence (a `*` value).
fn header_rule(name: &str, matcher: Option<StringMatcher>) -> Permission {
    Permission {
        rule: Some(permission::Rule::Header(HeaderMatcher {
            name: name.into(),
            header_match_specifier: Some(match matcher {
                Some(m) => header_matcher::HeaderMatchSpecifier::StringMatch(m),
                None => header_matcher::HeaderMatchSpecifier::PresentMatch(true),
            }),
            ..Default::default()
        })),
    }
}

fn path_rule(text: &str) -> Permission {
    let matcher = pattern(text, false).unwrap_or_else(|| StringMatcher {
        match_pattern: Some(string_matcher::MatchPattern::SafeRegex(RegexMatcher {
            regex: ANY_PATH.into(),
            ..Default::default()
        })),
        ignore_case: false,
    });
    Permission {
        rule: Some(permission::Rule::UrlPath(PathMatcher {
            rule: Some(path_matcher::Rule::Path(matcher)),
        })),
    }
}

// ---- Envoy -> model ----

/// The RBAC layers of one listener as they are read, in any order (each can only refuse, so
/// their order does not change the decision).
#[derive(Debug, Default)]
pub(crate) struct Layers {
    deny: Vec<model::AuthzPolicy>,
    /// `Some` once an ALLOW layer is read, even one without policies.
    allow: Option<Vec<model::AuthzPolicy>>,
    /// Where the ALLOW layer was, to name it when a second one comes.
    allow_at: String,
}

impl Layers {
    /// An `envoy.filters.http.rbac` typed_config (`at` names it).
    pub(crate) fn http(&mut self, any: &Any, at: &str) -> Result<()> {
        let mut f: HttpRbac = unpack(any, at)?;
        f.rules_stat_prefix.clear(); // statistics are named after the listener
        f.track_per_rule_stats = false;
        refuse_matcher(f.matcher.is_some(), f.shadow_matcher.is_some(), at)?;
        let rules = f.rules.take();
        reject_shadow(
            f.shadow_rules.is_some() || !f.shadow_rules_stat_prefix.is_empty(),
            at,
        )?;
        reject_rest(&f, at)?;
        self.add(rules, false, &format!("{at}.rules"))
    }

    /// An `envoy.filters.network.rbac` typed_config (`at` names it).
    pub(crate) fn network(&mut self, any: &Any, at: &str) -> Result<()> {
        let mut f: NetworkRbac = unpack(any, at)?;
        f.stat_prefix.clear();
        refuse_matcher(f.matcher.is_some(), f.shadow_matcher.is_some(), at)?;
        let rules = f.rules.take();
        reject_shadow(
            f.shadow_rules.is_some() || !f.shadow_rules_stat_prefix.is_empty(),
            at,
        )?;
        reject_rest(&f, at)?;
        self.add(rules, true, &format!("{at}.rules"))
    }

    fn add(&mut self, rules: Option<Rules>, tcp: bool, at: &str) -> Result<()> {
        // Without rules (and matcher) Envoy's filter enforces nothing.
        let Some(mut rules) = rules else {
            return Ok(());
        };
        let action = match rbac::Action::try_from(take(&mut rules.action)) {
            Ok(rbac::Action::Allow) => model::AuthzAction::Allow,
            Ok(rbac::Action::Deny) => model::AuthzAction::Deny,
            _ => {
                return Err(XdsError::resource(
                    format!("{at}.action"),
                    "only ALLOW and DENY are supported (LOG decides nothing; flatmesh logs every denial)",
                ))
            }
        };
        let mut named: Vec<(String, Policy)> = take(&mut rules.policies).into_iter().collect();
        reject_rest(&rules, at)?;
        // Envoy's policies are a map: within one layer any match gives the layer's action, so
        // their order does not matter; read them by name, for a stable config.
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let policies = named
            .into_iter()
            .map(|(name, p)| {
                let at = format!("{at}.policies[\"{name}\"]");
                policy_of(name, action, p, tcp, &at)
            })
            .collect::<Result<Vec<_>>>()?;
        match action {
            model::AuthzAction::Deny => self.deny.extend(policies),
            model::AuthzAction::Allow if self.allow.is_some() => {
                return Err(XdsError::resource(
                    at,
                    format!(
                        "is a second ALLOW RBAC (the first is {}): a request would have to match a policy of each, which flatmesh cannot say; merge them into one",
                        self.allow_at
                    ),
                ))
            }
            model::AuthzAction::Allow => {
                self.allow = Some(policies);
                self.allow_at = at.to_string();
            }
        }
        Ok(())
    }

    /// The listener's authorization; `None` without any RBAC. An ALLOW layer reads as
    /// `default: deny`: with it only an `allow` policy admits, whatever the default says.
    pub(crate) fn finish(self) -> Option<model::Authorization> {
        let default = if self.allow.is_some() {
            model::AuthzDefault::Deny
        } else {
            model::AuthzDefault::Allow
        };
        let mut policies = self.deny;
        policies.extend(self.allow.unwrap_or_default());
        (default == model::AuthzDefault::Deny || !policies.is_empty())
            .then_some(model::Authorization { default, policies })
    }
}

fn refuse_matcher(matcher: bool, shadow_matcher: bool, at: &str) -> Result<()> {
    let field = if matcher {
        "matcher"
    } else if shadow_matcher {
        "shadow_matcher"
    } else {
        return Ok(());
    };
    Err(XdsError::resource(
        format!("{at}.{field}"),
        "the unified matcher API is not supported; write `rules` (policies with principals and permissions)",
    ))
}

fn reject_shadow(shadow: bool, at: &str) -> Result<()> {
    if shadow {
        return Err(XdsError::resource(
            format!("{at}.shadow_rules"),
            "shadow rules are not supported: flatmesh enforces every policy it has; remove them, or make them `rules`",
        ));
    }
    Ok(())
}

fn policy_of(
    name: String,
    action: model::AuthzAction,
    mut p: Policy,
    tcp: bool,
    at: &str,
) -> Result<model::AuthzPolicy> {
    let principals = take(&mut p.principals);
    let permissions = take(&mut p.permissions);
    reject_rest(&p, at)?;
    let from = from_of(principals, &format!("{at}.principals"))?;
    let (to, when) = to_of(permissions, &format!("{at}.permissions"))?;
    if tcp && (to.is_some() || !when.is_empty()) {
        return Err(XdsError::resource(
            format!("{at}.permissions"),
            "a tcp listener sees connections, not requests: flatmesh's network RBAC matches only principals; write permissions: [{ any: true }]",
        ));
    }
    Ok(model::AuthzPolicy {
        name,
        action,
        from,
        to,
        when,
    })
}

// -- principals --

enum Caller {
    Principal(String),
    Namespace(String),
}

fn from_of(mut list: Vec<Principal>, at: &str) -> Result<Option<model::AuthzFrom>> {
    // Each part is a list of alternatives (an `or`), with where it was.
    let parts: Vec<(String, Vec<(Principal, String)>)> = match list.len() {
        0 => {
            return Err(XdsError::resource(
                at,
                "is empty: write [{ any: true }] for any caller",
            ))
        }
        1 => match list.remove(0).identifier {
            Some(principal::Identifier::Any(true)) => return Ok(None),
            Some(principal::Identifier::AndIds(set)) => set
                .ids
                .into_iter()
                .enumerate()
                .map(|(i, p)| or_ids_of(p, format!("{at}[0].and_ids.ids[{i}]")))
                .collect(),
            identifier => vec![or_ids_of(Principal { identifier }, format!("{at}[0]"))],
        },
        _ => vec![(
            at.to_string(),
            list.into_iter()
                .enumerate()
                .map(|(i, p)| (p, format!("{at}[{i}]")))
                .collect(),
        )],
    };
    let mut from = model::AuthzFrom::default();
    for (at, leaves) in parts {
        let callers = leaves
            .into_iter()
            .map(|(p, at)| caller(p, &at))
            .collect::<Result<Vec<_>>>()?;
        let (ids, namespaces): (Vec<_>, Vec<_>) = callers
            .into_iter()
            .partition(|c| matches!(c, Caller::Principal(_)));
        let unwrap = |c: Caller| match c {
            Caller::Principal(s) | Caller::Namespace(s) => s,
        };
        let (target, list, kind) = match (ids.is_empty(), namespaces.is_empty()) {
            (false, true) => (&mut from.principals, ids, "principals"),
            (true, false) => (&mut from.namespaces, namespaces, "namespaces"),
            (true, true) => {
                return Err(XdsError::resource(
                    at,
                    "is an empty `or`, which matches nothing; remove the policy",
                ))
            }
            _ => {
                return Err(XdsError::resource(
                    at,
                    "mixes SPIFFE IDs and namespaces in one `or`: flatmesh's `from` needs the caller to match its principals and its namespaces; put each kind in its own or_ids under and_ids",
                ))
            }
        };
        if !target.is_empty() {
            return Err(XdsError::resource(
                at,
                format!("is a second set of {kind} the caller must also match: flatmesh has one list of each; put them in one or_ids"),
            ));
        }
        *target = list.into_iter().map(unwrap).collect();
    }
    Ok(Some(from))
}

/// The alternatives of an `or_ids` (`at` names it), or the one principal it is.
fn or_ids_of(p: Principal, at: String) -> (String, Vec<(Principal, String)>) {
    match p.identifier {
        Some(principal::Identifier::OrIds(set)) => {
            let leaves = set
                .ids
                .into_iter()
                .enumerate()
                .map(|(i, p)| (p, format!("{at}.or_ids.ids[{i}]")))
                .collect();
            (at, leaves)
        }
        identifier => (at.clone(), vec![(Principal { identifier }, at)]),
    }
}

/// One `authenticated.principal_name`: a SPIFFE ID or `/*` pattern, or a namespace regex.
fn caller(p: Principal, at: &str) -> Result<Caller> {
    let Some(principal::Identifier::Authenticated(a)) = p.identifier else {
        return Err(XdsError::resource(
            at,
            "only `authenticated` (the caller's SPIFFE ID), and and_ids/or_ids of them, are supported: flatmesh knows its callers by certificate, not by address, header or metadata",
        ));
    };
    let at = format!("{at}.authenticated.principal_name");
    let Some(m) = a.principal_name else {
        return Err(XdsError::resource(
            at,
            "is missing: Envoy would match any authenticated caller; flatmesh matches SPIFFE IDs: write { prefix: \"spiffe://TD/\" } for every ID of a trust domain",
        ));
    };
    if let Some(string_matcher::MatchPattern::SafeRegex(r)) = &m.match_pattern {
        return namespace_of(r, m.ignore_case, &format!("{at}.safe_regex")).map(Caller::Namespace);
    }
    crate::tls::spiffe_text(m, &at).map(Caller::Principal)
}

fn namespace_of(r: &RegexMatcher, ignore_case: bool, at: &str) -> Result<String> {
    let wrong = || {
        XdsError::resource(
            format!("{at}.regex"),
            format!(
                "`{}` is not a namespace pattern: the only regex flatmesh reads is `{NS_HEAD}NAME{NS_TAIL}` (a caller in namespace NAME of any trust domain)",
                r.regex
            ),
        )
    };
    if ignore_case {
        return Err(wrong());
    }
    let mut rest = r.clone();
    let regex = take(&mut rest.regex);
    reject_rest(&rest, at)?;
    let escaped = regex
        .strip_prefix(NS_HEAD)
        .and_then(|r| r.strip_suffix(NS_TAIL))
        .ok_or_else(wrong)?;
    let mut name = String::new();
    let mut chars = escaped.chars();
    while let Some(c) = chars.next() {
        name.push(if c == '\\' {
            chars.next().ok_or_else(wrong)?
        } else {
            c
        });
    }
    if name.is_empty() || name.contains('/') || regex_escape(&name) != escaped {
        return Err(wrong());
    }
    Ok(name)
}

// -- permissions --

#[derive(PartialEq)]
enum Want {
    Method,
    Path,
    Host,
    Header(String),
}

fn to_of(
    mut list: Vec<Permission>,
    at: &str,
) -> Result<(Option<model::AuthzTo>, Vec<model::AuthzWhen>)> {
    // Each part is a list of alternatives (an `or`), with where it was.
    let parts: Vec<(String, Vec<(Permission, String)>)> = match list.len() {
        0 => {
            return Err(XdsError::resource(
                at,
                "is empty: write [{ any: true }] for any request",
            ))
        }
        1 => match list.remove(0).rule {
            Some(permission::Rule::Any(true)) => return Ok((None, Vec::new())),
            Some(permission::Rule::AndRules(set)) => set
                .rules
                .into_iter()
                .enumerate()
                .map(|(i, p)| or_rules_of(p, format!("{at}[0].and_rules.rules[{i}]")))
                .collect(),
            rule => vec![or_rules_of(Permission { rule }, format!("{at}[0]"))],
        },
        _ => vec![(
            at.to_string(),
            list.into_iter()
                .enumerate()
                .map(|(i, p)| (p, format!("{at}[{i}]")))
                .collect(),
        )],
    };
    let mut to = model::AuthzTo::default();
    let mut when = Vec::new();
    for (at, leaves) in parts {
        let mut kind: Option<Want> = None;
        let mut values = Vec::new();
        for (leaf, at) in leaves {
            let (k, value) = request_part(leaf, &at)?;
            if kind.as_ref().is_some_and(|seen| *seen != k) {
                return Err(XdsError::resource(
                    at,
                    "mixes kinds in one `or` (methods, paths, hosts, one header): flatmesh needs a request to match each kind it lists; put each kind in its own or_rules under and_rules",
                ));
            }
            kind = Some(k);
            values.push(value);
        }
        let target = match kind {
            None => {
                return Err(XdsError::resource(
                    at,
                    "is an empty `or`, which matches nothing; remove the policy",
                ))
            }
            Some(Want::Header(header)) => {
                when.push(model::AuthzWhen { header, values });
                continue;
            }
            Some(Want::Method) => &mut to.methods,
            Some(Want::Path) => &mut to.paths,
            Some(Want::Host) => &mut to.hosts,
        };
        if !target.is_empty() {
            return Err(XdsError::resource(
                at,
                "is a second set of methods, paths or hosts the request must also match: flatmesh has one list of each; put them in one or_rules",
            ));
        }
        *target = values;
    }
    let to = (to != model::AuthzTo::default()).then_some(to);
    Ok((to, when))
}

/// The alternatives of an `or_rules` (`at` names it), or the one permission it is.
fn or_rules_of(p: Permission, at: String) -> (String, Vec<(Permission, String)>) {
    match p.rule {
        Some(permission::Rule::OrRules(set)) => {
            let leaves = set
                .rules
                .into_iter()
                .enumerate()
                .map(|(i, p)| (p, format!("{at}.or_rules.rules[{i}]")))
                .collect();
            (at, leaves)
        }
        rule => (at.clone(), vec![(Permission { rule }, at)]),
    }
}

/// One permission: a `:method`, `:authority` or other header, or the URL path.
fn request_part(p: Permission, at: &str) -> Result<(Want, String)> {
    match p.rule {
        Some(permission::Rule::Header(h)) => {
            let at = format!("{at}.header");
            let name = h.name.to_ascii_lowercase();
            match name.as_str() {
                METHOD => {
                    let value = header_value(h, false, &at)?;
                    if value.contains('*') {
                        return Err(XdsError::resource(
                            at,
                            "a :method matcher must be `exact`: flatmesh matches methods by name",
                        ));
                    }
                    Ok((Want::Method, value))
                }
                AUTHORITY => Ok((Want::Host, header_value(h, true, &at)?)),
                _ if name.starts_with(':') => Err(XdsError::resource(
                    format!("{at}.name"),
                    format!("`{name}` is not supported: flatmesh's policies match :method, :authority (hosts) and plain request headers"),
                )),
                // Header names are case-insensitive in both; keep it as written.
                _ => {
                    let written = h.name.clone();
                    Ok((Want::Header(written), header_value(h, false, &at)?))
                }
            }
        }
        Some(permission::Rule::UrlPath(mut pm)) => {
            let at = format!("{at}.url_path");
            let Some(path_matcher::Rule::Path(m)) = pm.rule.take() else {
                return Err(XdsError::resource(
                    format!("{at}.path"),
                    "is missing: write { path: { exact | prefix | suffix: ... } }",
                ));
            };
            let at = format!("{at}.path");
            if let Some(string_matcher::MatchPattern::SafeRegex(r)) = &m.match_pattern {
                let mut rest = r.clone();
                if take(&mut rest.regex) == ANY_PATH && !m.ignore_case {
                    reject_rest(&rest, &format!("{at}.safe_regex"))?;
                    return Ok((Want::Path, "*".into()));
                }
            }
            Ok((Want::Path, pattern_of(m, false, &at)?))
        }
        _ => Err(XdsError::resource(
            at,
            "only header (:method, :authority, request headers) and url_path permissions, and and_rules/or_rules of them, are supported: flatmesh's policies match methods, paths, hosts and headers",
        )),
    }
}

/// A header matcher's value pattern (`*` for presence); `ignore_case` is what flatmesh does
/// for this header (hosts: yes, others: no), which the matcher must say too.
fn header_value(mut h: HeaderMatcher, ignore_case: bool, at: &str) -> Result<String> {
    h.name.clear();
    let specifier = h.header_match_specifier.take();
    reject_rest(&h, at)?;
    use header_matcher::HeaderMatchSpecifier as S;
    let text = |m: string_matcher::MatchPattern| StringMatcher {
        match_pattern: Some(m),
        ignore_case,
    };
    let m =
        match specifier {
            Some(S::PresentMatch(true)) => return Ok("*".into()),
            Some(S::StringMatch(m)) => m,
            Some(S::ExactMatch(v)) => text(string_matcher::MatchPattern::Exact(v)),
            Some(S::PrefixMatch(v)) => text(string_matcher::MatchPattern::Prefix(v)),
            Some(S::SuffixMatch(v)) => text(string_matcher::MatchPattern::Suffix(v)),
            _ => return Err(XdsError::resource(
                at,
                "only string_match (exact, prefix, suffix) and present_match: true are supported",
            )),
        };
    pattern_of(m, ignore_case, &format!("{at}.string_match"))
}

/// A string matcher as a flatmesh pattern: exact, `prefix*` or `*suffix`.
fn pattern_of(m: StringMatcher, ignore_case: bool, at: &str) -> Result<String> {
    if m.ignore_case != ignore_case {
        return Err(XdsError::resource(
            format!("{at}.ignore_case"),
            if ignore_case {
                "must be true: flatmesh compares hosts without case"
            } else {
                "must be false: flatmesh compares paths, methods and header values exactly"
            },
        ));
    }
    let (text, kind) = match m.match_pattern {
        Some(string_matcher::MatchPattern::Exact(v)) => (v, "exact"),
        Some(string_matcher::MatchPattern::Prefix(v)) => (v, "prefix"),
        Some(string_matcher::MatchPattern::Suffix(v)) => (v, "suffix"),
        _ => {
            return Err(XdsError::resource(
                at,
                "only exact, prefix and suffix are supported (flatmesh's patterns are `exact`, `prefix*`, `*suffix`)",
            ))
        }
    };
    if text.contains('*') || (kind != "exact" && text.is_empty()) {
        return Err(XdsError::resource(
            format!("{at}.{kind}"),
            format!("`{text}` cannot be written as a flatmesh pattern (no `*` inside, not empty)"),
        ));
    }
    Ok(match kind {
        "prefix" => format!("{text}*"),
        "suffix" => format!("*{text}"),
        _ => text,
    })
}
