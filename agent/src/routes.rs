//! Envoy rate-limit domains: which Sluice task (and key) answers a descriptor.
//!
//! The manager compiles each imported envoyproxy/ratelimit configuration (`POST
//! /api/v1/import/envoy-ratelimit`) into a tree of nodes and its leader mirrors it into the
//! Redis hash `NS:envoy` (field = domain). The agent re-reads that hash every
//! `--routes-refresh` and matches descriptors locally, exactly as envoyproxy/ratelimit walks
//! its configuration: at each level the child whose key **and** value equal the entry's, else
//! the first child (in config order) with that key whose value is a pattern the entry's value
//! fits (`*` = any run of characters: [`pattern_matches`]; each matched value its own limit
//! unless `share_threshold`), else the child with that key and no value (a wildcard: every
//! distinct value gets its own limit);
//! the node matched by the descriptor's **last** entry gives the limit.
//!
//! Besides imported domains, any domain accepts the direct form: a descriptor whose entries
//! are `sluice_task = <task>` and optionally `sluice_key = <key>` addresses that task (and key)
//! as it is, for tasks created through the API.
//!
//! Data read back from Redis is validated like input: a domain whose JSON does not parse or
//! breaks a rule is skipped (and logged once per version); its previous version stays in use.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use serde::Deserialize;

/// Entry key of the direct form naming the task.
pub const DIRECT_TASK: &str = "sluice_task";
/// Entry key of the direct form naming the key.
pub const DIRECT_KEY: &str = "sluice_key";
/// Deepest tree accepted from Redis.
pub const MAX_DEPTH: usize = 16;
/// Most nodes of one domain accepted from Redis.
pub const MAX_NODES: usize = 100_000;

/// One compiled node (the manager's `<Node>` JSON).
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct Node {
    /// Entry key.
    pub key: String,
    /// Entry value; `None` = any value (its own limit per value).
    #[serde(default)]
    pub value: Option<String>,
    /// The Sluice task of this node's limit (`None`: no limit here, or unlimited).
    #[serde(default)]
    pub task: Option<String>,
    /// `rate_limit.unlimited`.
    #[serde(default)]
    pub unlimited: bool,
    /// `shadow_mode`.
    #[serde(default)]
    pub shadow: bool,
    /// `quota_mode`: over its limit, this descriptor alone does not refuse the request; the
    /// request is refused when every `quota_mode` descriptor of it is over.
    #[serde(default)]
    pub quota: bool,
    /// `value` is a pattern (`*` = any run of characters): upstream's value wildcards.
    #[serde(default)]
    pub pattern: bool,
    /// `share_threshold`: every value the pattern matches shares one limit (not part of the
    /// key); otherwise each matched value has its own.
    #[serde(default)]
    pub share: bool,
    /// `rate_limit.name`.
    #[serde(default)]
    pub name: Option<String>,
    /// Names of the limits this one replaces.
    #[serde(default)]
    pub replaces: Vec<String>,
    /// `rate_limit.unit` (`second`, `minute`, `hour`, `day`).
    #[serde(default)]
    pub unit: Option<String>,
    /// `rate_limit.requests_per_unit`.
    #[serde(default)]
    pub requests_per_unit: Option<u64>,
    /// The task is keyed by the values at the wildcard positions of the path.
    #[serde(default)]
    pub keyed: bool,
    /// Children.
    #[serde(default)]
    pub descriptors: Vec<Node>,
}

#[derive(Debug, Deserialize)]
struct DomainDoc {
    domain: String,
    #[serde(default)]
    version: u64,
    #[serde(default)]
    descriptors: Vec<Node>,
}

/// A limit as Envoy's `RateLimit` message states it.
#[derive(Debug, Clone, PartialEq)]
pub struct LimitSpec {
    /// `name`.
    pub name: Option<String>,
    /// `requests_per_unit`.
    pub requests_per_unit: u64,
    /// `unit`.
    pub unit: Unit,
}

pub use sluice_protocol::envoy::Unit;

/// What a descriptor resolved to.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// No limit applies (no match, or a node without a limit).
    None,
    /// `unlimited: true`: always OK, counted nowhere.
    Unlimited,
    /// A Sluice task, and the key within it for a keyed task.
    Limit {
        /// Task name.
        task: String,
        /// Key (keyed tasks).
        key: Option<String>,
        /// The limit as configured (for `current_limit`), when imported.
        spec: Option<LimitSpec>,
        /// `shadow_mode` of the imported node.
        shadow: bool,
        /// Names this limit replaces.
        replaces: Vec<String>,
        /// `quota_mode` of the imported node.
        quota: bool,
    },
}

/// One domain's tree, indexed for matching.
#[derive(Debug, Default)]
struct Tree {
    version: u64,
    children: Level,
}

/// The nodes of one level.
#[derive(Debug, Default)]
struct Level {
    /// `key\0value` (value present, patterns too) or `key` (wildcard) → node.
    map: HashMap<String, TreeNode>,
    /// The pattern values of this level in config order: (key, the pattern split at `*`, the
    /// node's `map` key).
    patterns: Vec<(String, Vec<String>, String)>,
}

#[derive(Debug)]
struct TreeNode {
    node_limit: Option<NodeLimit>,
    wildcard: bool,
    /// Matched through a pattern whose values each have their own limit (the value is part
    /// of the key).
    per_value: bool,
    children: Level,
}

/// Whether `value` fits `parts` (a pattern split at `*`): it starts with the first part, ends
/// with the last, and holds the middle ones in order between them, without overlap.
///
/// ```
/// # use sluice_agent::routes::pattern_matches;
/// let p = |s: &str| s.split('*').map(str::to_string).collect::<Vec<_>>();
/// assert!(pattern_matches(&p("foo*"), "foobar"));
/// assert!(pattern_matches(&p("foo*"), "foo"));
/// assert!(!pattern_matches(&p("foo*"), "fo"));
/// assert!(pattern_matches(&p("a*b*c"), "axxbyyc"));
/// assert!(!pattern_matches(&p("a*b*c"), "acb"));
/// assert!(!pattern_matches(&p("ab*ba"), "aba"));
/// ```
pub fn pattern_matches(parts: &[String], value: &str) -> bool {
    let (Some(first), Some(last)) = (parts.first(), parts.last()) else {
        return false;
    };
    if parts.len() == 1 {
        return first == value;
    }
    if value.len() < parts.iter().map(String::len).sum::<usize>()
        || !value.starts_with(first.as_str())
        || !value.ends_with(last.as_str())
    {
        return false;
    }
    let mut rest = &value[first.len()..value.len() - last.len()];
    for p in &parts[1..parts.len() - 1] {
        match rest.find(p.as_str()) {
            Some(i) => rest = &rest[i + p.len()..],
            None => return false,
        }
    }
    true
}

#[derive(Debug, Clone)]
struct NodeLimit {
    task: Option<String>,
    unlimited: bool,
    keyed: bool,
    spec: Option<LimitSpec>,
    shadow: bool,
    quota: bool,
    replaces: Vec<String>,
}

fn exact(key: &str, value: &str) -> String {
    format!("{key}\0{value}")
}

fn index(nodes: &[Node], depth: usize, count: &mut usize) -> Result<Level, String> {
    if depth > MAX_DEPTH {
        return Err(format!("deeper than {MAX_DEPTH} levels"));
    }
    let mut out = Level {
        map: HashMap::with_capacity(nodes.len()),
        patterns: Vec::new(),
    };
    for n in nodes {
        *count += 1;
        if *count > MAX_NODES {
            return Err(format!("more than {MAX_NODES} nodes"));
        }
        if n.key.is_empty() {
            return Err("a node has an empty key".into());
        }
        let limit = if n.task.is_some() || n.unlimited {
            if let Some(t) = &n.task {
                sluice_protocol::validate_task_name(t).map_err(|e| e.to_string())?;
            }
            let spec = match (&n.unit, n.requests_per_unit) {
                (Some(u), Some(r)) => Some(LimitSpec {
                    name: n.name.clone(),
                    requests_per_unit: r,
                    unit: Unit::parse(u).ok_or_else(|| format!("unit {u:?}"))?,
                }),
                _ => None,
            };
            Some(NodeLimit {
                task: n.task.clone(),
                unlimited: n.unlimited,
                keyed: n.keyed,
                spec,
                shadow: n.shadow,
                quota: n.quota,
                replaces: n.replaces.clone(),
            })
        } else {
            None
        };
        let k = match &n.value {
            Some(v) => exact(&n.key, v),
            None => n.key.clone(),
        };
        let pattern = n.pattern && n.value.as_deref().is_some_and(|v| v.contains('*'));
        if pattern && let Some(v) = &n.value {
            let parts = v.split('*').map(str::to_string).collect();
            out.patterns.push((n.key.clone(), parts, k.clone()));
        }
        let node = TreeNode {
            node_limit: limit,
            wildcard: n.value.is_none(),
            per_value: pattern && !n.share,
            children: index(&n.descriptors, depth + 1, count)?,
        };
        if out.map.insert(k, node).is_some() {
            return Err(format!(
                "two nodes {:?} = {:?} at one level",
                n.key,
                n.value.as_deref().unwrap_or("*")
            ));
        }
    }
    Ok(out)
}

/// Escapes `|` and `\` of one key part.
fn escape_part(v: &str, out: &mut String) {
    for c in v.chars() {
        if c == '|' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
}

/// The key of a keyed task from the values at the wildcard positions: joined with `|` (`\`
/// escapes `|` and `\`), `sha256:<hex>` of that when longer than 256 bytes.
pub fn key_of(parts: &[&str]) -> String {
    let mut k = String::new();
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            k.push('|');
        }
        escape_part(p, &mut k);
    }
    if k.len() > sluice_protocol::MAX_KEY_LEN {
        let d = ring::digest::digest(&ring::digest::SHA256, k.as_bytes());
        let mut h = String::with_capacity(7 + 64);
        h.push_str("sha256:");
        for b in d.as_ref() {
            h.push_str(&format!("{b:02x}"));
        }
        return h;
    }
    k
}

impl Tree {
    fn resolve(&self, entries: &[(&str, &str)]) -> Target {
        let mut level = &self.children;
        let mut wild: Vec<&str> = Vec::new();
        for (i, (k, v)) in entries.iter().enumerate() {
            // As envoyproxy/ratelimit: the exact value, else the first pattern (in config
            // order) the value fits, else the node without value.
            let exact_node = level.map.get(&exact(k, v));
            let (node, by_pattern) = match exact_node {
                Some(n) => (n, false),
                None => match level
                    .patterns
                    .iter()
                    .find(|(pk, parts, _)| pk == k && pattern_matches(parts, v))
                    .and_then(|(_, _, mk)| level.map.get(mk))
                {
                    Some(n) => (n, true),
                    None => match level.map.get(*k) {
                        Some(n) if n.wildcard => (n, false),
                        _ => return Target::None,
                    },
                },
            };
            if node.wildcard || (by_pattern && node.per_value) {
                wild.push(v);
            }
            if i + 1 == entries.len() {
                return match &node.node_limit {
                    None => Target::None,
                    Some(l) if l.unlimited => Target::Unlimited,
                    Some(l) => match &l.task {
                        None => Target::None,
                        Some(t) => Target::Limit {
                            task: t.clone(),
                            key: (l.keyed || !wild.is_empty()).then(|| key_of(&wild)),
                            spec: l.spec.clone(),
                            shadow: l.shadow,
                            replaces: l.replaces.clone(),
                            quota: l.quota,
                        },
                    },
                };
            }
            if node.children.map.is_empty() {
                return Target::None;
            }
            level = &node.children;
        }
        Target::None
    }
}

/// Every domain the agent knows, swapped whole on each refresh.
#[derive(Debug, Default)]
pub struct Routes {
    /// Shared with the previous refresh while a domain's version is unchanged.
    domains: HashMap<String, Arc<Tree>>,
}

impl Routes {
    /// Resolves one descriptor of `domain` (entries in order).
    pub fn resolve(&self, domain: &str, entries: &[(&str, &str)]) -> Target {
        if let Some(t) = self.domains.get(domain) {
            match t.resolve(entries) {
                Target::None => {}
                found => return found,
            }
        }
        direct(entries)
    }

    /// Domains and their versions.
    pub fn versions(&self) -> Vec<(String, u64)> {
        let mut v: Vec<_> = self
            .domains
            .iter()
            .map(|(d, t)| (d.clone(), t.version))
            .collect();
        v.sort();
        v
    }
}

/// The direct form: `sluice_task = T` [, `sluice_key = K`].
fn direct(entries: &[(&str, &str)]) -> Target {
    match entries {
        [(DIRECT_TASK, t)] => Target::Limit {
            task: t.to_string(),
            key: None,
            spec: None,
            shadow: false,
            replaces: Vec::new(),
            quota: false,
        },
        [(DIRECT_TASK, t), (DIRECT_KEY, k)] => Target::Limit {
            task: t.to_string(),
            key: Some(k.to_string()),
            spec: None,
            shadow: false,
            replaces: Vec::new(),
            quota: false,
        },
        _ => Target::None,
    }
}

/// The shared, refreshed routes.
#[derive(Debug, Default, Clone)]
pub struct RouteTable {
    inner: Arc<RwLock<Arc<Routes>>>,
    loaded: Arc<std::sync::atomic::AtomicBool>,
}

impl RouteTable {
    /// The current routes.
    pub fn load(&self) -> Arc<Routes> {
        self.inner.read().map(|g| g.clone()).unwrap_or_default()
    }

    /// True once the hash was read at least once.
    pub fn loaded(&self) -> bool {
        self.loaded.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Replaces the routes from the hash `NS:envoy` (`domain → JSON`). A domain whose JSON is
    /// bad keeps its previous version; the errors are returned (domain, why).
    pub fn apply(&self, raw: &HashMap<String, String>) -> Vec<(String, String)> {
        let old = self.load();
        let mut errors = Vec::new();
        let mut domains = HashMap::with_capacity(raw.len());
        for (domain, json) in raw {
            let old_tree = old.domains.get(domain);
            let parsed = serde_json::from_str::<DomainDoc>(json)
                .map_err(|e| e.to_string())
                .and_then(|d| {
                    if &d.domain != domain {
                        return Err(format!("names domain {:?}", d.domain));
                    }
                    if old_tree.is_some_and(|t| t.version == d.version && d.version != 0) {
                        return Ok(None);
                    }
                    let mut count = 0;
                    let children = index(&d.descriptors, 1, &mut count)?;
                    Ok(Some(Arc::new(Tree {
                        version: d.version,
                        children,
                    })))
                });
            match parsed {
                Ok(Some(t)) => {
                    domains.insert(domain.clone(), t);
                }
                // Unchanged (same version): the tree already built is kept, not rebuilt.
                Ok(None) => {
                    if let Some(t) = old_tree {
                        domains.insert(domain.clone(), t.clone());
                    }
                }
                Err(why) => {
                    errors.push((domain.clone(), why));
                    if let Some(t) = old_tree {
                        domains.insert(domain.clone(), t.clone());
                    }
                }
            }
        }
        if let Ok(mut g) = self.inner.write() {
            *g = Arc::new(Routes { domains });
        }
        self.loaded
            .store(true, std::sync::atomic::Ordering::Release);
        errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(json: &str) -> RouteTable {
        let t = RouteTable::default();
        let mut raw = HashMap::new();
        raw.insert("d".to_string(), json.to_string());
        assert!(t.apply(&raw).is_empty());
        t
    }

    const DOC: &str = r#"{"domain":"d","version":1,"descriptors":[
        {"key":"database","value":"users","task":"d.database_users","unit":"second","requests_per_unit":500},
        {"key":"remote_address","task":"d.remote_address","keyed":true,"unit":"minute","requests_per_unit":10},
        {"key":"source","value":"proxy","descriptors":[
            {"key":"dest","value":"bank","task":"d.source_proxy.dest_bank","shadow":true,"unit":"second","requests_per_unit":5},
            {"key":"dest","task":"d.source_proxy.dest","keyed":true,"unit":"hour","requests_per_unit":7,"name":"n1","replaces":["x"]}
        ]},
        {"key":"path","value":"/health","unlimited":true}
    ]}"#;

    fn limit(t: &Target) -> (&str, Option<&str>) {
        match t {
            Target::Limit { task, key, .. } => (task, key.as_deref()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn matching_follows_envoyproxy_ratelimit() {
        let r = table(DOC).load();
        assert_eq!(
            limit(&r.resolve("d", &[("database", "users")])),
            ("d.database_users", None)
        );
        assert_eq!(r.resolve("d", &[("database", "other")]), Target::None);
        assert_eq!(
            limit(&r.resolve("d", &[("remote_address", "10.0.0.1")])),
            ("d.remote_address", Some("10.0.0.1"))
        );
        let t = r.resolve("d", &[("source", "proxy"), ("dest", "bank")]);
        assert!(matches!(&t, Target::Limit { shadow: true, .. }));
        assert_eq!(
            limit(&r.resolve("d", &[("source", "proxy"), ("dest", "atm")])),
            ("d.source_proxy.dest", Some("atm"))
        );
        // The intermediate node has no limit; a longer descriptor matches nothing.
        assert_eq!(r.resolve("d", &[("source", "proxy")]), Target::None);
        assert_eq!(
            r.resolve("d", &[("database", "users"), ("x", "y")]),
            Target::None
        );
        assert_eq!(r.resolve("d", &[("path", "/health")]), Target::Unlimited);
        assert_eq!(r.resolve("other", &[("database", "users")]), Target::None);
        // The direct form works in any domain.
        assert_eq!(
            limit(&r.resolve("any", &[("sluice_task", "t1"), ("sluice_key", "k")])),
            ("t1", Some("k"))
        );
    }

    /// Upstream's order at one level: the exact value, then the first pattern the value fits
    /// (config order), then the node without value; a pattern's value is part of the key
    /// unless it is shared; `quota` reaches the target.
    #[test]
    fn patterns_sit_between_exact_values_and_wildcards() {
        let r = table(
            r#"{"domain":"d","version":1,"descriptors":[
            {"key":"p","value":"/a*","pattern":true,"task":"d.first","keyed":true},
            {"key":"p","value":"/ab*","pattern":true,"task":"d.second","keyed":true},
            {"key":"p","value":"/s*","pattern":true,"share":true,"task":"d.shared","quota":true},
            {"key":"p","value":"/abc","task":"d.exact"},
            {"key":"p","task":"d.any","keyed":true}
        ]}"#,
        )
        .load();
        assert_eq!(limit(&r.resolve("d", &[("p", "/abc")])), ("d.exact", None));
        // "/abd" fits both patterns: the first in config order wins.
        assert_eq!(
            limit(&r.resolve("d", &[("p", "/abd")])),
            ("d.first", Some("/abd"))
        );
        assert_eq!(limit(&r.resolve("d", &[("p", "/s/1")])), ("d.shared", None));
        assert!(matches!(
            r.resolve("d", &[("p", "/s/1")]),
            Target::Limit { quota: true, .. }
        ));
        assert_eq!(
            limit(&r.resolve("d", &[("p", "/z")])),
            ("d.any", Some("/z"))
        );
        // A pattern of another key does not match.
        assert_eq!(r.resolve("d", &[("q", "/abc")]), Target::None);
    }

    /// The reference: a plain recursive glob (`*` = any run of characters, every other
    /// character itself).
    fn glob(p: &[u8], v: &[u8]) -> bool {
        match p.split_first() {
            None => v.is_empty(),
            Some((b'*', rest)) => (0..=v.len()).any(|i| glob(rest, &v[i..])),
            Some((c, rest)) => v.first() == Some(c) && glob(rest, &v[1..]),
        }
    }

    /// `pattern_matches` agrees with the reference glob on random patterns and values over a
    /// small alphabet (so matches, overlaps and near misses are frequent); never panics.
    #[test]
    fn prop_pattern_matches_the_reference_glob() {
        use proptest::prelude::*;
        use proptest::test_runner::TestRunner;
        let mut runner =
            TestRunner::new(sluice_testkit::prop_config("routes pattern matching", 512));
        let strategy = ("[ab*]{0,8}", "[ab]{0,10}");
        runner
            .run(&strategy, |(pattern, value)| {
                let parts: Vec<String> = pattern.split('*').map(str::to_string).collect();
                prop_assert_eq!(
                    pattern_matches(&parts, &value),
                    glob(pattern.as_bytes(), value.as_bytes()),
                    "pattern {:?} value {:?}",
                    pattern,
                    value
                );
                Ok(())
            })
            .unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn keys_escape_and_hash() {
        assert_eq!(key_of(&["a"]), "a");
        assert_eq!(key_of(&["a|b", "c\\"]), "a\\|b|c\\\\");
        let long = "x".repeat(300);
        let k = key_of(&[&long]);
        assert!(k.starts_with("sha256:") && k.len() == 71, "{k}");
    }

    #[test]
    fn bad_data_from_redis_keeps_the_previous_version() {
        let t = table(DOC);
        let mut raw = HashMap::new();
        raw.insert(
            "d".to_string(),
            r#"{"domain":"d","version":2,"descriptors":[{"key":"a","task":"bad name"}]}"#
                .to_string(),
        );
        raw.insert("e".to_string(), "not json".to_string());
        let errs = t.apply(&raw);
        assert_eq!(errs.len(), 2, "{errs:?}");
        let r = t.load();
        assert_eq!(r.versions(), vec![("d".to_string(), 1)]);
        assert!(matches!(
            r.resolve("d", &[("database", "users")]),
            Target::Limit { .. }
        ));
        // A domain gone from the hash is gone.
        assert!(t.apply(&HashMap::new()).is_empty());
        assert_eq!(
            t.load().resolve("d", &[("database", "users")]),
            Target::None
        );
    }
}
