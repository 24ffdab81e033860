//! Drop-in for envoyproxy/ratelimit: its YAML domain configs, compiled into Sluice tasks.
//!
//! ```text
//!  POST /api/v1/import/envoy-ratelimit (YAML)
//!     │  parse (positions kept) → validate → compile
//!     ▼
//!  one etcd transaction: /NS/envoy/<domain> + /NS/tasks/<task>… (puts and deletes)
//!     │
//!     ├─ task watch ─▶ Roller (meta, slices) as for any task
//!     └─ mirror (leader, fenced) ─▶ Redis NS:envoy[<domain>] = {"domain","version","descriptors"}
//! ```
//!
//! * [`parse`]: the YAML text → [`Domain`], every error naming the field path
//!   (`descriptors[0].rate_limit.unit`) and the line. One document per request.
//! * [`compile`]: [`Domain`] → the contract's `<Node>` JSON plus one task spec per node with a
//!   limited `rate_limit`, validated by [`crate::spec::parse_request`] like a `PUT` body.
//! * [`apply`] / [`remove`] / [`list`]: the etcd side, one transaction each.
//! * [`mirror`]: the leader's loop copying domain documents into `NS:envoy`, each domain
//!   fenced by the leader's epoch and term like a task (`NS:envoy:fence{NS:envoy}`), so two
//!   manager clusters on one namespace keep their own domains.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, GetOptions, Txn, TxnOp, TxnOpResponse};
use redis::Script;
use ring::digest;
use serde_json::{Value, json};
use sluice_protocol::conn::Redis;
use sluice_protocol::{Keys, unix_ms};
use tracing::{debug, info, warn};
use yaml_rust2::parser::{Event, Parser};
use yaml_rust2::scanner::TScalarStyle;

use crate::election::{ETCD_TIMEOUT, LeaderContext};
use crate::error::{Error, Result, etcd};
use crate::spec::{MAX_COUNT, MAX_DESCRIPTION, TaskSpec, parse_request, parse_stored};

/// Largest YAML body, in bytes.
pub const MAX_YAML_BYTES: usize = 256 * 1024;
/// Deepest descriptor nesting (a path of at most this many key/value entries).
pub const MAX_DEPTH: usize = 8;
/// Most descriptor nodes in one domain.
pub const MAX_NODES: usize = 1000;
/// Most tasks (limited `rate_limit` blocks) in one domain: an import is one etcd transaction,
/// and etcd allows 128 operations in one (`--max-txn-ops`): the domain document plus, in the
/// worst case, every task of the old import deleted and every task of the new one created.
pub const MAX_TASKS: usize = 60;
/// Longest domain name (it is the first part of every task name).
pub const MAX_DOMAIN_LEN: usize = 40;
/// Longest descriptor key or value, in bytes.
pub const MAX_TEXT: usize = 256;
/// Most YAML events (scalars, mappings, sequences) read, aliases expanded.
const MAX_EVENTS: usize = 50_000;
/// A conflicting concurrent write is retried this often before the import answers 409.
const TXN_ATTEMPTS: usize = 3;

/// What is wrong with an import, where: the API answers `{"error", "field", "line"}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} (line {line:?}): {error}")]
pub struct ImportError {
    /// Human-readable message.
    pub error: String,
    /// Path of the field (`descriptors[0].rate_limit.unit`), `""` for the whole document.
    pub field: String,
    /// 1-based line of the YAML text, when one is at fault.
    pub line: Option<usize>,
}

fn ie(field: impl Into<String>, line: usize, error: impl Into<String>) -> ImportError {
    ImportError {
        error: error.into(),
        field: field.into(),
        line: (line > 0).then_some(line),
    }
}

// ---------------------------------------------------------------------------------------------
// YAML → a small tree that keeps lines.

#[derive(Debug, Clone)]
enum Y {
    Scalar { text: String, plain: bool },
    Map(Vec<(String, usize, YNode)>),
    Seq(Vec<YNode>),
}

#[derive(Debug, Clone)]
struct YNode {
    v: Y,
    line: usize,
}

impl YNode {
    fn size(&self) -> usize {
        match &self.v {
            Y::Scalar { .. } => 1,
            Y::Map(m) => 1 + m.iter().map(|(_, _, n)| 1 + n.size()).sum::<usize>(),
            Y::Seq(s) => 1 + s.iter().map(YNode::size).sum::<usize>(),
        }
    }

    /// A plain `~`, `null`, or nothing: YAML's null.
    fn is_null(&self) -> bool {
        matches!(&self.v, Y::Scalar { text, plain: true }
            if text.is_empty() || text == "~" || text.eq_ignore_ascii_case("null"))
    }

    fn kind(&self) -> &'static str {
        match &self.v {
            Y::Scalar { .. } => "a scalar",
            Y::Map(_) => "a mapping",
            Y::Seq(_) => "a list",
        }
    }
}

enum Frame {
    Map {
        line: usize,
        anchor: usize,
        entries: Vec<(String, usize, YNode)>,
        pending_key: Option<(String, usize)>,
    },
    Seq {
        line: usize,
        anchor: usize,
        items: Vec<YNode>,
    },
}

/// Parses one YAML document into a tree (aliases expanded, every size bounded).
fn load_yaml(text: &str) -> Result<YNode, ImportError> {
    let mut parser = Parser::new_from_str(text);
    let mut stack: Vec<Frame> = Vec::new();
    let mut anchors: HashMap<usize, YNode> = HashMap::new();
    let mut root: Option<YNode> = None;
    let mut documents = 0usize;
    let mut budget = MAX_EVENTS;
    loop {
        let (ev, mark) = parser.next_token().map_err(|e| {
            ie(
                "",
                e.marker().line(),
                format!("malformed YAML: {}", e.info()),
            )
        })?;
        let line = mark.line();
        let node = match ev {
            Event::StreamEnd => break,
            Event::StreamStart | Event::Nothing | Event::DocumentEnd => continue,
            Event::DocumentStart => {
                documents += 1;
                if documents > 1 {
                    return Err(ie(
                        "",
                        line,
                        "one YAML document per import (one domain); import each domain separately",
                    ));
                }
                continue;
            }
            Event::MappingStart(anchor, _) => {
                if stack.len() > 4 * MAX_DEPTH + 4 {
                    return Err(ie("", line, "nested too deeply"));
                }
                stack.push(Frame::Map {
                    line,
                    anchor,
                    entries: Vec::new(),
                    pending_key: None,
                });
                continue;
            }
            Event::SequenceStart(anchor, _) => {
                if stack.len() > 4 * MAX_DEPTH + 4 {
                    return Err(ie("", line, "nested too deeply"));
                }
                stack.push(Frame::Seq {
                    line,
                    anchor,
                    items: Vec::new(),
                });
                continue;
            }
            Event::MappingEnd => match stack.pop() {
                Some(Frame::Map {
                    line,
                    anchor,
                    entries,
                    ..
                }) => {
                    let n = YNode {
                        v: Y::Map(entries),
                        line,
                    };
                    if anchor > 0 {
                        anchors.insert(anchor, n.clone());
                    }
                    n
                }
                _ => return Err(ie("", line, "malformed YAML: unbalanced mapping")),
            },
            Event::SequenceEnd => match stack.pop() {
                Some(Frame::Seq {
                    line,
                    anchor,
                    items,
                }) => {
                    let n = YNode {
                        v: Y::Seq(items),
                        line,
                    };
                    if anchor > 0 {
                        anchors.insert(anchor, n.clone());
                    }
                    n
                }
                _ => return Err(ie("", line, "malformed YAML: unbalanced list")),
            },
            Event::Scalar(text, style, anchor, _) => {
                let n = YNode {
                    v: Y::Scalar {
                        text,
                        plain: style == TScalarStyle::Plain,
                    },
                    line,
                };
                if anchor > 0 {
                    anchors.insert(anchor, n.clone());
                }
                n
            }
            Event::Alias(id) => {
                let n = anchors
                    .get(&id)
                    .cloned()
                    .ok_or_else(|| ie("", line, "alias of an unknown anchor"))?;
                let size = n.size();
                if size > budget {
                    return Err(ie("", line, "document too large (aliases expanded)"));
                }
                budget -= size;
                n
            }
        };
        budget = budget
            .checked_sub(1)
            .ok_or_else(|| ie("", line, "document too large"))?;
        match stack.last_mut() {
            None => root = Some(node),
            Some(Frame::Seq { items, .. }) => items.push(node),
            Some(Frame::Map {
                entries,
                pending_key,
                ..
            }) => match pending_key.take() {
                None => match node.v {
                    // Duplicate keys are refused by `Fields::new`, which knows the path.
                    Y::Scalar { text, .. } => *pending_key = Some((text, node.line)),
                    _ => return Err(ie("", node.line, "mapping keys must be plain text")),
                },
                Some((k, kline)) => entries.push((k, kline, node)),
            },
        }
    }
    root.ok_or_else(|| {
        ie(
            "",
            0,
            "empty document: expected `domain:` and `descriptors:`",
        )
    })
}

// ---------------------------------------------------------------------------------------------
// The tree → a validated domain.

pub use sluice_protocol::envoy::Unit;

/// A `rate_limit` block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimit {
    /// `unlimited: true`: matched, never limited (no task).
    pub unlimited: bool,
    /// `unit` (None only when unlimited).
    pub unit: Option<Unit>,
    /// `requests_per_unit` (None only when unlimited).
    pub requests_per_unit: Option<u64>,
    /// `name`.
    pub name: Option<String>,
    /// `replaces[].name`, with the line of each.
    pub replaces: Vec<(String, usize)>,
}

/// One descriptor node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    /// `key`.
    pub key: String,
    /// `value` (None = a wildcard: every value its own limit).
    pub value: Option<String>,
    /// `rate_limit`.
    pub rate_limit: Option<RateLimit>,
    /// `shadow_mode`.
    pub shadow: bool,
    /// `quota_mode`.
    pub quota: bool,
    /// `share_threshold` (only on a pattern value): every value the pattern matches shares
    /// one limit instead of each having its own.
    pub share: bool,
    /// Nested `descriptors`.
    pub descriptors: Vec<Descriptor>,
    /// Where it is (`descriptors[0].descriptors[1]`).
    pub field: String,
    /// Its line.
    pub line: usize,
}

/// A parsed domain config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Domain {
    /// `domain`.
    pub domain: String,
    /// Top-level `descriptors`.
    pub descriptors: Vec<Descriptor>,
}

fn join(path: &str, k: &str) -> String {
    if path.is_empty() {
        k.to_string()
    } else {
        format!("{path}.{k}")
    }
}

struct Fields<'a> {
    path: String,
    line: usize,
    entries: &'a [(String, usize, YNode)],
}

impl<'a> Fields<'a> {
    fn new(path: &str, n: &'a YNode, allowed: &[&str]) -> Result<Self, ImportError> {
        let Y::Map(entries) = &n.v else {
            return Err(ie(
                path,
                n.line,
                format!("must be a mapping, got {}", n.kind()),
            ));
        };
        for (i, (k, line, _)) in entries.iter().enumerate() {
            if let Some((_, first, _)) = entries[..i].iter().find(|(p, _, _)| p == k) {
                return Err(ie(
                    join(path, k),
                    *line,
                    format!("duplicate key (first at line {first})"),
                ));
            }
            if !allowed.contains(&k.as_str()) {
                return Err(ie(
                    join(path, k),
                    *line,
                    format!("unknown key; expected one of: {}", allowed.join(", ")),
                ));
            }
        }
        Ok(Self {
            path: path.to_string(),
            line: n.line,
            entries,
        })
    }

    fn field(&self, k: &str) -> String {
        join(&self.path, k)
    }

    /// The value of `k`, unless absent or null.
    fn get(&self, k: &str) -> Option<&'a YNode> {
        self.entries
            .iter()
            .find(|(key, _, _)| key == k)
            .map(|(_, _, n)| n)
            .filter(|n| !n.is_null())
    }

    fn string(&self, k: &str) -> Result<Option<(&'a str, usize)>, ImportError> {
        match self.get(k) {
            None => Ok(None),
            Some(YNode {
                v: Y::Scalar { text, .. },
                line,
            }) => Ok(Some((text.as_str(), *line))),
            Some(n) => Err(ie(
                self.field(k),
                n.line,
                format!("must be text, got {}", n.kind()),
            )),
        }
    }

    fn bool(&self, k: &str) -> Result<bool, ImportError> {
        match self.get(k) {
            None => Ok(false),
            Some(YNode {
                v: Y::Scalar { text, plain: true },
                line,
            }) => match text.as_str() {
                "true" | "True" | "TRUE" => Ok(true),
                "false" | "False" | "FALSE" => Ok(false),
                _ => Err(ie(self.field(k), *line, "must be true or false")),
            },
            Some(n) => Err(ie(self.field(k), n.line, "must be true or false")),
        }
    }

    fn list(&self, k: &str) -> Result<&'a [YNode], ImportError> {
        match self.get(k) {
            None => Ok(&[]),
            Some(YNode { v: Y::Seq(s), .. }) => Ok(s),
            Some(n) => Err(ie(
                self.field(k),
                n.line,
                format!("must be a list, got {}", n.kind()),
            )),
        }
    }
}

const DOMAIN_KEYS: &[&str] = &["domain", "descriptors"];
const DESCRIPTOR_KEYS: &[&str] = &[
    "key",
    "value",
    "rate_limit",
    "shadow_mode",
    "quota_mode",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
    "descriptors",
];

/// Largest `metadata` of one descriptor, in bytes of its text (keys and scalars).
pub const MAX_METADATA_BYTES: usize = 4096;
const RATE_LIMIT_KEYS: &[&str] = &["unit", "requests_per_unit", "unlimited", "name", "replaces"];

/// A value with `*`: a pattern (`*` = any run of characters), as upstream's value wildcards.
pub fn is_pattern(v: &str) -> bool {
    v.contains('*')
}

fn is_name_part(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
}

struct Counter {
    nodes: usize,
    tasks: usize,
}

/// Parses and validates an envoyproxy/ratelimit YAML config (one domain).
pub fn parse(text: &str) -> Result<Domain, ImportError> {
    if text.len() > MAX_YAML_BYTES {
        return Err(ie(
            "",
            0,
            format!("the config is larger than {MAX_YAML_BYTES} bytes"),
        ));
    }
    let root = load_yaml(text)?;
    let top = Fields::new("", &root, DOMAIN_KEYS)?;
    let (domain, dline) = top
        .string("domain")?
        .ok_or_else(|| ie("domain", root.line, "is required"))?;
    if !is_name_part(domain) || domain.len() > MAX_DOMAIN_LEN {
        return Err(ie(
            "domain",
            dline,
            format!(
                "must be 1 to {MAX_DOMAIN_LEN} characters of A-Z a-z 0-9 _ - (it names the domain's tasks)"
            ),
        ));
    }
    let mut count = Counter { nodes: 0, tasks: 0 };
    let descriptors = parse_list("", top.list("descriptors")?, 1, &mut count)?;
    let d = Domain {
        domain: domain.to_string(),
        descriptors,
    };
    // `replaces` must name a limit of this domain.
    let mut names = BTreeSet::new();
    walk(&d.descriptors, &mut |n: &Descriptor| {
        if let Some(name) = n.rate_limit.as_ref().and_then(|r| r.name.as_ref()) {
            names.insert(name.clone());
        }
    });
    let mut bad = None;
    walk(&d.descriptors, &mut |n: &Descriptor| {
        if let Some(r) = &n.rate_limit {
            for (i, (name, line)) in r.replaces.iter().enumerate() {
                if bad.is_none() && r.name.as_ref() == Some(name) {
                    // envoyproxy/ratelimit refuses this too: the limit would switch itself
                    // off in every request that matches it.
                    bad = Some(ie(
                        format!("{}.rate_limit.replaces[{i}].name", n.field),
                        *line,
                        format!(
                            "{name:?} is its own name: a rate_limit cannot replace itself (it would never apply; envoyproxy/ratelimit refuses it too)"
                        ),
                    ));
                }
                if bad.is_none() && !names.contains(name) {
                    bad = Some(ie(
                        format!("{}.rate_limit.replaces[{i}].name", n.field),
                        *line,
                        format!("{name:?} is not the name of any rate_limit in this domain"),
                    ));
                }
            }
        }
    });
    if let Some(e) = bad {
        return Err(e);
    }
    Ok(d)
}

fn walk(list: &[Descriptor], f: &mut impl FnMut(&Descriptor)) {
    for d in list {
        f(d);
        walk(&d.descriptors, f);
    }
}

fn parse_list(
    path: &str,
    items: &[YNode],
    depth: usize,
    count: &mut Counter,
) -> Result<Vec<Descriptor>, ImportError> {
    let mut out: Vec<Descriptor> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let field = format!("{}[{i}]", join(path, "descriptors"));
        if depth > MAX_DEPTH {
            return Err(ie(
                &field,
                item.line,
                format!("descriptors are nested more than {MAX_DEPTH} levels deep"),
            ));
        }
        count.nodes += 1;
        if count.nodes > MAX_NODES {
            return Err(ie(
                &field,
                item.line,
                format!("more than {MAX_NODES} descriptors in one domain"),
            ));
        }
        let d = parse_descriptor(&field, item, depth, count)?;
        if let Some(prev) = out.iter().find(|p| p.key == d.key && p.value == d.value) {
            return Err(ie(
                &field,
                d.line,
                format!(
                    "duplicate descriptor: key {:?}{} is already defined at line {}",
                    d.key,
                    d.value
                        .as_ref()
                        .map(|v| format!(" value {v:?}"))
                        .unwrap_or_default(),
                    prev.line
                ),
            ));
        }
        out.push(d);
    }
    Ok(out)
}

fn parse_descriptor(
    field: &str,
    n: &YNode,
    depth: usize,
    count: &mut Counter,
) -> Result<Descriptor, ImportError> {
    let o = Fields::new(field, n, DESCRIPTOR_KEYS)?;
    let (key, kline) = o
        .string("key")?
        .ok_or_else(|| ie(o.field("key"), o.line, "is required"))?;
    if key.is_empty() || key.len() > MAX_TEXT {
        return Err(ie(
            o.field("key"),
            kline,
            format!("must be 1 to {MAX_TEXT} bytes"),
        ));
    }
    let value = match o.string("value")? {
        None | Some(("", _)) => None,
        Some((v, line)) => {
            if v.len() > MAX_TEXT {
                return Err(ie(
                    o.field("value"),
                    line,
                    format!("must be at most {MAX_TEXT} bytes"),
                ));
            }
            // A `*` makes the value a pattern (upstream's value wildcards): matched by the
            // agent, see `sluice_agent::routes`.
            Some(v.to_string())
        }
    };
    let shadow = o.bool("shadow_mode")?;
    let share = o.bool("share_threshold")?;
    if share && !value.as_deref().is_some_and(is_pattern) {
        let line = o.get("share_threshold").map_or(o.line, |n| n.line);
        return Err(ie(
            o.field("share_threshold"),
            line,
            "share_threshold needs a value with `*` (a pattern): it makes every value the pattern matches share one limit",
        ));
    }
    // Accepted for compatibility: Sluice keeps per-task metrics for every limit anyway.
    o.bool("detailed_metric")?;
    o.bool("value_to_metric")?;
    // A request is refused by its quota_mode descriptors only when all of them are over.
    let quota = o.bool("quota_mode")?;
    // Free-form, as upstream: it only returns it in response dynamic metadata, which Sluice
    // does not send. Checked (a mapping, bounded) and otherwise ignored.
    if let Some(md) = o.get("metadata") {
        if !matches!(md.v, Y::Map(_)) {
            return Err(ie(
                o.field("metadata"),
                md.line,
                format!("must be a mapping, got {}", md.kind()),
            ));
        }
        if text_bytes(md) > MAX_METADATA_BYTES {
            return Err(ie(
                o.field("metadata"),
                md.line,
                format!("larger than {MAX_METADATA_BYTES} bytes"),
            ));
        }
    }
    let rate_limit = match o.get("rate_limit") {
        None => None,
        Some(r) => Some(parse_rate_limit(&o.field("rate_limit"), r)?),
    };
    if rate_limit.as_ref().is_some_and(|r| !r.unlimited) {
        count.tasks += 1;
        if count.tasks > MAX_TASKS {
            return Err(ie(
                o.field("rate_limit"),
                o.line,
                format!(
                    "more than {MAX_TASKS} limited rate_limit blocks in one domain (each is a Sluice task; split the domain)"
                ),
            ));
        }
    }
    let descriptors = parse_list(field, o.list("descriptors")?, depth + 1, count)?;
    Ok(Descriptor {
        key: key.to_string(),
        value,
        rate_limit,
        shadow,
        share,
        quota,
        descriptors,
        field: field.to_string(),
        line: n.line,
    })
}

/// Bytes of the keys and scalars of a YAML node.
fn text_bytes(n: &YNode) -> usize {
    match &n.v {
        Y::Scalar { text, .. } => text.len() + 1,
        Y::Map(m) => m.iter().map(|(k, _, v)| k.len() + 1 + text_bytes(v)).sum(),
        Y::Seq(v) => v.iter().map(text_bytes).sum(),
    }
}

fn parse_rate_limit(field: &str, n: &YNode) -> Result<RateLimit, ImportError> {
    let o = Fields::new(field, n, RATE_LIMIT_KEYS)?;
    let unlimited = o.bool("unlimited")?;
    let name = o.string("name")?.map(|(s, _)| s.to_string());
    let mut replaces = Vec::new();
    for (i, r) in o.list("replaces")?.iter().enumerate() {
        let rf = format!("{}[{i}]", o.field("replaces"));
        let ro = Fields::new(&rf, r, &["name"])?;
        let (nm, line) = ro
            .string("name")?
            .ok_or_else(|| ie(ro.field("name"), r.line, "is required"))?;
        replaces.push((nm.to_string(), line));
    }
    let unit = match o.string("unit")? {
        None => None,
        Some((u, line)) => {
            let lower = u.to_ascii_lowercase();
            match (Unit::parse(&lower), lower.as_str()) {
                (Some(unit), _) => Some(unit),
                (None, "week" | "month" | "year") => {
                    return Err(ie(
                        o.field("unit"),
                        line,
                        format!(
                            "{u:?} cannot be expressed: a Sluice slice is at most one day; use second, minute, hour or day"
                        ),
                    ));
                }
                (None, _) => {
                    return Err(ie(
                        o.field("unit"),
                        line,
                        format!("unknown unit {u:?}; expected second, minute, hour or day"),
                    ));
                }
            }
        }
    };
    let rpu = match o.get("requests_per_unit") {
        None => None,
        Some(YNode {
            v: Y::Scalar { text, plain: true },
            line,
        }) => Some(
            text.parse::<u64>()
                .ok()
                .filter(|n| *n <= MAX_COUNT)
                .ok_or_else(|| {
                    ie(
                        o.field("requests_per_unit"),
                        *line,
                        format!("must be a whole number from 0 to {MAX_COUNT}"),
                    )
                })?,
        ),
        Some(n) => {
            return Err(ie(
                o.field("requests_per_unit"),
                n.line,
                format!("must be a whole number from 0 to {MAX_COUNT}"),
            ));
        }
    };
    if unlimited {
        if let Some(k) = ["unit", "requests_per_unit"]
            .into_iter()
            .find(|k| o.get(k).is_some())
        {
            return Err(ie(
                o.field(k),
                o.get(k).map_or(o.line, |n| n.line),
                "must not be given with unlimited: true",
            ));
        }
    } else {
        if unit.is_none() {
            return Err(ie(
                o.field("unit"),
                o.line,
                "is required (unless unlimited: true)",
            ));
        }
        if rpu.is_none() {
            return Err(ie(
                o.field("requests_per_unit"),
                o.line,
                "is required (unless unlimited: true)",
            ));
        }
    }
    Ok(RateLimit {
        unlimited,
        unit,
        requests_per_unit: rpu,
        name,
        replaces,
    })
}

// ---------------------------------------------------------------------------------------------
// The domain → `<Node>` JSON and task specs.

/// A task the import creates.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedTask {
    /// Task name.
    pub name: String,
    /// The descriptor path (`k=v / k2`).
    pub path: String,
    /// The validated spec.
    pub spec: TaskSpec,
    /// Field of the node.
    pub field: String,
    /// Line of the node.
    pub line: usize,
}

impl PlannedTask {
    /// As listed in the import answer.
    pub fn to_json(&self) -> Value {
        json!({
            "name": self.name,
            "path": self.path,
            "threshold": self.spec.threshold,
            "slice_ms": self.spec.slice_ms,
            "keyed": self.spec.keyed,
            "shadow": self.spec.shadow,
        })
    }
}

/// A compiled domain.
#[derive(Debug, Clone, PartialEq)]
pub struct Compiled {
    /// The domain.
    pub domain: String,
    /// The contract's `<Node>` list.
    pub descriptors: Vec<Value>,
    /// One task per limited `rate_limit`, in document order.
    pub tasks: Vec<PlannedTask>,
}

/// The task name of a descriptor path (see `docs/api.md`): readable `<domain>.<seg>…` when
/// every part is `[A-Za-z0-9_-]` and the whole fits in 64 bytes, else a hashed form.
pub fn task_name(domain: &str, path: &[(&str, Option<&str>)]) -> String {
    let readable = is_name_part(domain)
        && path
            .iter()
            .all(|(k, v)| is_name_part(k) && v.is_none_or(is_name_part));
    if readable {
        let mut s = domain.to_string();
        for (k, v) in path {
            s.push('.');
            s.push_str(k);
            if let Some(v) = v {
                s.push('_');
                s.push_str(v);
            }
        }
        if s.len() <= sluice_protocol::MAX_TASK_NAME_LEN {
            return s;
        }
    }
    hashed_name(domain, path)
}

fn hashed_name(domain: &str, path: &[(&str, Option<&str>)]) -> String {
    let mut input = domain.to_string();
    for (k, v) in path {
        input.push('\n');
        input.push_str(k);
        if let Some(v) = v {
            input.push('=');
            input.push_str(v);
        }
    }
    let d = digest::digest(&digest::SHA256, input.as_bytes());
    let hex: String = d.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    let prefix: String = domain
        .chars()
        .take(24)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{prefix}.h{}", &hex[..20])
}

fn path_text(path: &[(&str, Option<&str>)]) -> String {
    path.iter()
        .map(|(k, v)| match v {
            Some(v) => format!("{k}={v}"),
            None => k.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" / ")
}

/// Compiles a parsed domain: `<Node>` JSON and the validated task specs.
pub fn compile(d: &Domain) -> Result<Compiled, ImportError> {
    // Names first: two paths can make the same readable name (`a_b` + `c` and `a` + `b_c`);
    // such names fall back to the hashed form, which includes the separators.
    let mut paths: Vec<(DescPath, &Descriptor)> = Vec::new();
    collect_paths(&d.descriptors, &mut Vec::new(), &mut paths);
    let mut by_name: BTreeMap<String, usize> = BTreeMap::new();
    let readable: Vec<String> = paths
        .iter()
        .map(|(p, _)| task_name(&d.domain, &as_refs(p)))
        .collect();
    for n in &readable {
        *by_name.entry(n.clone()).or_default() += 1;
    }
    // By field (`descriptors[2].descriptors[0]`), unique per node.
    let mut names: HashMap<String, String> = HashMap::new();
    let mut seen = BTreeSet::new();
    for ((p, node), n) in paths.iter().zip(readable) {
        let name = if by_name[&n] > 1 {
            hashed_name(&d.domain, &as_refs(p))
        } else {
            n
        };
        if !seen.insert(name.clone()) {
            return Err(ie(
                &node.field,
                node.line,
                format!("task name {name:?} is made twice; rename a key or value"),
            ));
        }
        names.insert(node.field.clone(), name);
    }
    let mut tasks = Vec::new();
    let descriptors = compile_list(
        d,
        &d.descriptors,
        &mut Vec::new(),
        false,
        &names,
        &mut tasks,
    )?;
    Ok(Compiled {
        domain: d.domain.clone(),
        descriptors,
        tasks,
    })
}

/// A descriptor path: (key, value) from the root.
type DescPath = Vec<(String, Option<String>)>;

fn as_refs(p: &[(String, Option<String>)]) -> Vec<(&str, Option<&str>)> {
    p.iter().map(|(k, v)| (k.as_str(), v.as_deref())).collect()
}

fn collect_paths<'a>(
    list: &'a [Descriptor],
    prefix: &mut Vec<(String, Option<String>)>,
    out: &mut Vec<(DescPath, &'a Descriptor)>,
) {
    for d in list {
        prefix.push((d.key.clone(), d.value.clone()));
        if d.rate_limit.as_ref().is_some_and(|r| !r.unlimited) {
            out.push((prefix.clone(), d));
        }
        collect_paths(&d.descriptors, prefix, out);
        prefix.pop();
    }
}

fn compile_list(
    d: &Domain,
    list: &[Descriptor],
    prefix: &mut Vec<(String, Option<String>)>,
    keyed_above: bool,
    names: &HashMap<String, String>,
    tasks: &mut Vec<PlannedTask>,
) -> Result<Vec<Value>, ImportError> {
    let mut out = Vec::with_capacity(list.len());
    for n in list {
        prefix.push((n.key.clone(), n.value.clone()));
        // Every value its own limit below a node without value, and below a pattern (unless
        // its values share one).
        let keyed = keyed_above
            || n.value.is_none()
            || (n.value.as_deref().is_some_and(is_pattern) && !n.share);
        let task = match &n.rate_limit {
            Some(r) if !r.unlimited => {
                let name = names.get(&n.field).cloned().unwrap_or_default();
                let path = path_text(&as_refs(prefix));
                let mut description =
                    format!("envoy-ratelimit {}: {} (line {})", d.domain, path, n.line);
                if description.chars().count() > MAX_DESCRIPTION {
                    description = description.chars().take(MAX_DESCRIPTION - 1).collect();
                    description.push('…');
                }
                let body = json!({
                    "threshold": r.requests_per_unit.unwrap_or(0),
                    "slice_ms": r.unit.map_or(1000, Unit::slice_ms),
                    "keyed": keyed,
                    "shadow": n.shadow,
                    "description": description,
                });
                let spec = parse_request(&name, body.to_string().as_bytes())
                    .map_err(|e| {
                        ie(
                            join(&format!("{}.rate_limit", n.field), &e.field),
                            n.line,
                            e.error,
                        )
                    })?
                    .spec;
                tasks.push(PlannedTask {
                    name: name.clone(),
                    path,
                    spec,
                    field: n.field.clone(),
                    line: n.line,
                });
                Some(name)
            }
            _ => None,
        };
        let r = n.rate_limit.as_ref();
        let children = compile_list(d, &n.descriptors, prefix, keyed, names, tasks)?;
        out.push(json!({
            "key": n.key,
            "value": n.value,
            "task": task,
            "unlimited": r.is_some_and(|r| r.unlimited),
            "shadow": n.shadow,
            "quota": n.quota,
            "pattern": n.value.as_deref().is_some_and(is_pattern),
            "share": n.share,
            "name": r.and_then(|r| r.name.clone()),
            "replaces": r
                .map(|r| r.replaces.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>())
                .unwrap_or_default(),
            "unit": r.and_then(|r| r.unit).map(Unit::as_str),
            "requests_per_unit": r.and_then(|r| r.requests_per_unit),
            "keyed": keyed,
            "descriptors": children,
        }));
        prefix.pop();
    }
    Ok(out)
}

/// Parses and compiles in one step.
pub fn prepare(text: &str) -> Result<Compiled, ImportError> {
    compile(&parse(text)?)
}

// ---------------------------------------------------------------------------------------------
// etcd: the domain document and the tasks, one transaction.

/// The stored domain document (`/NS/envoy/<domain>`), as far as the import reads it back.
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct DomainDoc {
    /// The domain.
    #[serde(default)]
    pub domain: String,
    /// When it was imported (unix ms).
    #[serde(default)]
    pub imported_ms: i64,
    /// Tasks it made.
    #[serde(default)]
    pub tasks: Vec<String>,
    /// The compiled `<Node>` list.
    #[serde(default)]
    pub descriptors: Vec<Value>,
}

/// What an import changed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Applied {
    /// Tasks created.
    pub created: Vec<String>,
    /// Tasks whose spec changed.
    pub updated: Vec<String>,
    /// Tasks already as compiled.
    pub unchanged: Vec<String>,
    /// Tasks of the previous import no longer in the config, deleted.
    pub deleted: Vec<String>,
    /// etcd revision of the write (the domain's `version`).
    pub version: i64,
}

/// Why an import or delete was refused without writing anything.
#[derive(Debug, Clone, PartialEq)]
pub enum Refused {
    /// The task exists and was not made by this domain's import.
    NotOurs {
        /// The task.
        task: String,
        /// Field of the node that would make it.
        field: String,
        /// Its line.
        line: usize,
    },
    /// Someone else kept writing the same keys.
    Busy,
    /// No such domain (delete).
    NoDomain,
}

async fn read_doc(client: &Client, key: &str) -> Result<(Option<DomainDoc>, i64)> {
    let mut c = client.clone();
    let resp = etcd("get envoy domain", ETCD_TIMEOUT, c.get(key, None)).await?;
    Ok(match resp.kvs().first() {
        None => (None, 0),
        Some(kv) => {
            let doc =
                serde_json::from_slice::<DomainDoc>(kv.value()).map_err(|e| Error::Corrupt {
                    what: format!("envoy domain document {key}"),
                    why: e.to_string(),
                })?;
            (Some(doc), kv.mod_revision())
        }
    })
}

/// Reads several task keys at one revision: name → (value, mod revision).
async fn read_tasks(
    client: &Client,
    keys: &Keys,
    names: &BTreeSet<String>,
) -> Result<HashMap<String, (Vec<u8>, i64)>> {
    if names.is_empty() {
        return Ok(HashMap::new());
    }
    let ops: Vec<TxnOp> = names
        .iter()
        .map(|n| TxnOp::get(keys.etcd_task(n), None))
        .collect();
    let mut c = client.clone();
    let resp = etcd(
        "read envoy tasks",
        ETCD_TIMEOUT,
        c.txn(Txn::new().and_then(ops)),
    )
    .await?;
    let mut out = HashMap::new();
    for (name, op) in names.iter().zip(resp.op_responses()) {
        if let TxnOpResponse::Get(g) = op
            && let Some(kv) = g.kvs().first()
        {
            out.insert(name.clone(), (kv.value().to_vec(), kv.mod_revision()));
        }
    }
    Ok(out)
}

/// Stores a compiled domain and its tasks in one etcd transaction: tasks of the previous
/// import of the domain that are gone are deleted, changed ones replaced; a task name that
/// exists but is not the domain's is refused. Nothing is written on a refusal.
pub async fn apply(
    client: &Client,
    keys: &Keys,
    compiled: &Compiled,
    yaml: &str,
) -> Result<std::result::Result<Applied, Refused>> {
    let doc_key = keys.etcd_envoy_domain(&compiled.domain);
    for attempt in 0..TXN_ATTEMPTS {
        let (old, doc_rev) = read_doc(client, &doc_key).await?;
        let owned: BTreeSet<String> = old
            .map(|d| d.tasks)
            .unwrap_or_default()
            .into_iter()
            .collect();
        let mut all: BTreeSet<String> = owned.clone();
        all.extend(compiled.tasks.iter().map(|t| t.name.clone()));
        let stored = read_tasks(client, keys, &all).await?;

        let mut out = Applied::default();
        let mut compares = vec![Compare::mod_revision(
            doc_key.as_str(),
            CompareOp::Equal,
            doc_rev,
        )];
        let mut ops = Vec::new();
        for t in &compiled.tasks {
            let key = keys.etcd_task(&t.name);
            let value = serde_json::to_vec(&t.spec).map_err(|e| Error::Corrupt {
                what: "spec".into(),
                why: e.to_string(),
            })?;
            match stored.get(&t.name) {
                None => {
                    compares.push(Compare::mod_revision(key.as_str(), CompareOp::Equal, 0));
                    ops.push(TxnOp::put(key, value, None));
                    out.created.push(t.name.clone());
                }
                Some(_) if !owned.contains(&t.name) => {
                    return Ok(Err(Refused::NotOurs {
                        task: t.name.clone(),
                        field: t.field.clone(),
                        line: t.line,
                    }));
                }
                Some((bytes, rev)) => {
                    if parse_stored(&t.name, bytes).is_ok_and(|s| s == t.spec) {
                        out.unchanged.push(t.name.clone());
                    } else {
                        compares.push(Compare::mod_revision(key.as_str(), CompareOp::Equal, *rev));
                        ops.push(TxnOp::put(key, value, None));
                        out.updated.push(t.name.clone());
                    }
                }
            }
        }
        let new_names: BTreeSet<&str> = compiled.tasks.iter().map(|t| t.name.as_str()).collect();
        for name in &owned {
            if new_names.contains(name.as_str()) {
                continue;
            }
            if let Some((_, rev)) = stored.get(name) {
                let key = keys.etcd_task(name);
                compares.push(Compare::mod_revision(key.as_str(), CompareOp::Equal, *rev));
                ops.push(TxnOp::delete(key, None));
                out.deleted.push(name.clone());
            }
        }
        let doc = json!({
            "domain": compiled.domain,
            "imported_ms": unix_ms(),
            "yaml": yaml,
            "tasks": compiled.tasks.iter().map(|t| t.name.clone()).collect::<Vec<_>>(),
            "descriptors": compiled.descriptors,
        });
        ops.push(TxnOp::put(doc_key.as_str(), doc.to_string(), None));
        let mut c = client.clone();
        let resp = etcd(
            "import envoy domain",
            ETCD_TIMEOUT,
            c.txn(Txn::new().when(compares).and_then(ops)),
        )
        .await?;
        if resp.succeeded() {
            out.version = resp.header().map_or(0, |h| h.revision());
            return Ok(Ok(out));
        }
        debug!(
            domain = compiled.domain,
            attempt, "envoy import raced another write; retrying"
        );
    }
    Ok(Err(Refused::Busy))
}

/// Deletes a domain document and the tasks of its import, in one transaction.
pub async fn remove(
    client: &Client,
    keys: &Keys,
    domain: &str,
) -> Result<std::result::Result<Vec<String>, Refused>> {
    let doc_key = keys.etcd_envoy_domain(domain);
    for _ in 0..TXN_ATTEMPTS {
        let (old, doc_rev) = read_doc(client, &doc_key).await?;
        let Some(old) = old else {
            return Ok(Err(Refused::NoDomain));
        };
        let mut ops = vec![TxnOp::delete(doc_key.as_str(), None)];
        ops.extend(
            old.tasks
                .iter()
                .map(|t| TxnOp::delete(keys.etcd_task(t), None)),
        );
        let mut c = client.clone();
        let resp = etcd(
            "delete envoy domain",
            ETCD_TIMEOUT,
            c.txn(
                Txn::new()
                    .when([Compare::mod_revision(
                        doc_key.as_str(),
                        CompareOp::Equal,
                        doc_rev,
                    )])
                    .and_then(ops),
            ),
        )
        .await?;
        if resp.succeeded() {
            return Ok(Ok(old.tasks));
        }
    }
    Ok(Err(Refused::Busy))
}

/// Every stored domain: (document, mod revision), by domain.
pub async fn list(client: &Client, keys: &Keys) -> Result<(Vec<(DomainDoc, i64)>, i64)> {
    let prefix = keys.etcd_envoy_prefix();
    let mut c = client.clone();
    let resp = etcd(
        "list envoy domains",
        ETCD_TIMEOUT,
        c.get(prefix.as_str(), Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let mut out = Vec::new();
    for kv in resp.kvs() {
        let key = String::from_utf8_lossy(kv.key());
        let Some(name) = key.strip_prefix(prefix.as_str()) else {
            continue;
        };
        match serde_json::from_slice::<DomainDoc>(kv.value()) {
            Ok(mut d) => {
                d.domain = name.to_string();
                out.push((d, kv.mod_revision()));
            }
            Err(e) => {
                warn!(domain = %name, %e, "stored envoy domain document is unreadable; skipped")
            }
        }
    }
    Ok((out, resp.header().map_or(0, |h| h.revision())))
}

// ---------------------------------------------------------------------------------------------
// The leader's mirror into Redis `NS:envoy`.

/// The fence preamble of the mirror scripts (`protocol/scripts/parts/mirror_fence.lua`; the Lua text
/// of the mirror scripts lives there with the protocol's, see docs/protocol.md): the per-domain
/// counterpart of the task fence (`sluice_protocol::scripts::FENCE_LUA`). KEYS[2] = the fence hash (`NS:envoy:fence{NS:envoy}`),
/// field = domain, value = `"<epoch> <term> <fenced_ms>"`; ARGV[1] = domain, ARGV[2..4] = the
/// writer's term, epoch, stale_after (ms).
///
/// ```text
///   no fence stored ............................... comparable (legacy, or never written)
///   stored epoch equal, stored term ≤ term ......... comparable
///   stored epoch equal, term > ours, fresh ......... refused {0, term, age}
///   stored epoch other, fresh ...................... refused {4, term, age, epoch}
///   stored fence stale (≥ stale_after) ............. taken over (not comparable)
/// ```
///
/// Defines `now`, `fence_of()` → (refusal or nil, comparable: versions of one history and no
/// takeover, mine: this very term holds the fence, age of the stored fence in ms) and `claim()`.
macro_rules! mirror_fence {
    () => {
        include_str!("../../protocol/scripts/parts/mirror_fence.lua")
    };
}

/// Writes a domain's compiled JSON, fenced (`parts/mirror_fence.lua`), unless the stored one is as
/// new or newer of this epoch's history (a stored version above the revision the leader just
/// read comes from another history). A document already as new only gets its fence claimed or
/// refreshed (at least every quarter of stale_after, so a live owner's fence never goes stale).
/// `KEYS[1]` = NS:envoy, `KEYS[2]` = the fence hash; ARGV = domain, term, epoch, stale_after,
/// version, value, revision read. Returns `{1}` written, `{2}` unchanged, or a refusal.
pub const MIRROR_SET_LUA: &str = concat!(
    mirror_fence!(),
    include_str!("../../protocol/scripts/parts/mirror_set.lua"),
);

/// Deletes a domain's field (and its fence), fenced (`parts/mirror_fence.lua`), unless it was written
/// from a document of this epoch newer than the revision at which the leader saw the domain
/// gone. KEYS as [`MIRROR_SET_LUA`]; ARGV = domain, term, epoch, stale_after, revision read.
/// Returns `{1}` deleted, `{2}` nothing to delete, `{3}` newer, or a refusal.
pub const MIRROR_DEL_LUA: &str = concat!(
    mirror_fence!(),
    include_str!("../../protocol/scripts/parts/mirror_del.lua"),
);

static MIRROR_SET: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(MIRROR_SET_LUA));
static MIRROR_DEL: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(MIRROR_DEL_LUA));

/// The compiled JSON the leader writes for a domain (`NS:envoy` field value).
pub fn routes_value(doc: &DomainDoc, version: i64) -> Value {
    json!({
        "domain": doc.domain,
        "version": version.max(0) as u64,
        "descriptors": doc.descriptors,
    })
}

/// What one mirror pass did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MirrorPass {
    /// Domains written.
    pub written: usize,
    /// Domains removed.
    pub removed: usize,
    /// Domains another leader holds (a newer term, or another manager cluster — another etcd —
    /// on the namespace) whose fence is fresh: neither written nor deleted, (domain, why).
    pub refused: Vec<(String, String)>,
}

/// The refusal of a mirror script's reply, if it is one.
fn mirror_refusal(reply: &[redis::Value]) -> Option<String> {
    let int = |i: usize| -> i64 {
        reply
            .get(i)
            .and_then(|v| redis::from_redis_value_ref::<i64>(v).ok())
            .unwrap_or(0)
    };
    match int(0) {
        0 => Some(format!(
            "held by a newer leader (term {}, written {} ms ago)",
            int(1),
            int(2)
        )),
        4 => Some(format!(
            "written by another manager cluster (epoch {}, term {}) {} ms ago",
            reply
                .get(3)
                .and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
                .unwrap_or_default(),
            int(1),
            int(2)
        )),
        _ => None,
    }
}

/// One pass: make `NS:envoy` equal to the domain documents in etcd, for the domains this
/// leader may write (every write fenced by its term and epoch, per domain, as slice keys are:
/// two manager clusters on one namespace each keep their own domains, and a domain both
/// import stays the first one's until its fence goes stale).
pub async fn mirror_once(
    ctx: &LeaderContext,
    client: &Client,
    keys: &Keys,
    redis: &Redis,
) -> Result<MirrorPass> {
    let (docs, revision) = list(client, keys).await?;
    mirror_docs(ctx, &docs, revision, keys, redis).await
}

/// The Redis half of [`mirror_once`]: makes `NS:envoy` equal to `docs` (each with its etcd
/// version), read from etcd at `revision` (the deterministic simulation calls it with its own
/// documents; the manager only through [`mirror_once`]).
pub async fn mirror_docs(
    ctx: &LeaderContext,
    docs: &[(DomainDoc, i64)],
    revision: i64,
    keys: &Keys,
    redis: &Redis,
) -> Result<MirrorPass> {
    let hash = keys.envoy_routes();
    let fence_hash = keys.envoy_fence();
    let fence = ctx.fence();
    let mut c = redis
        .conn()
        .await
        .map_err(crate::error::redis("envoy mirror"))?;
    let stored: Vec<String> = redis::cmd("HKEYS")
        .arg(&hash)
        .query_async(&mut c)
        .await
        .map_err(crate::error::redis("envoy mirror read"))?;
    let mut pass = MirrorPass::default();
    for (doc, version) in docs {
        if !ctx.is_valid() {
            return Err(Error::NotLeader);
        }
        let reply: Vec<redis::Value> = MIRROR_SET
            .key(&hash)
            .key(&fence_hash)
            .arg(&doc.domain)
            .arg(fence.term)
            .arg(fence.epoch.to_string())
            .arg(fence.stale_after_ms.max(1))
            .arg(*version)
            .arg(routes_value(doc, *version).to_string())
            .arg(revision)
            .invoke_async(&mut c)
            .await
            .map_err(crate::error::redis("envoy mirror write"))?;
        if let Some(why) = mirror_refusal(&reply) {
            pass.refused.push((doc.domain.clone(), why));
        } else if reply
            .first()
            .and_then(|v| redis::from_redis_value_ref::<i64>(v).ok())
            == Some(1)
        {
            info!(domain = doc.domain, version, "envoy domain mirrored");
            pass.written += 1;
        }
    }
    let live: BTreeSet<&str> = docs.iter().map(|(d, _)| d.domain.as_str()).collect();
    for field in stored.iter().filter(|f| !live.contains(f.as_str())) {
        if !ctx.is_valid() {
            return Err(Error::NotLeader);
        }
        let reply: Vec<redis::Value> = MIRROR_DEL
            .key(&hash)
            .key(&fence_hash)
            .arg(field)
            .arg(fence.term)
            .arg(fence.epoch.to_string())
            .arg(fence.stale_after_ms.max(1))
            .arg(revision)
            .invoke_async(&mut c)
            .await
            .map_err(crate::error::redis("envoy mirror delete"))?;
        if let Some(why) = mirror_refusal(&reply) {
            pass.refused.push((field.clone(), why));
        } else if reply
            .first()
            .and_then(|v| redis::from_redis_value_ref::<i64>(v).ok())
            == Some(1)
        {
            info!(domain = field, "envoy domain removed from the mirror");
            pass.removed += 1;
        }
    }
    Ok(pass)
}

/// Leader-only: mirrors etcd's domain documents into `NS:envoy` every `every` until the
/// leadership ends (the same period as rolling; one etcd range read, one HKEYS and one script
/// call per domain a pass). Domains refused by the fence are logged when the set changes.
pub async fn mirror(
    ctx: LeaderContext,
    client: Client,
    keys: Keys,
    redis: Arc<Redis>,
    every: Duration,
) {
    let mut failing = false;
    let mut refused: Vec<(String, String)> = Vec::new();
    loop {
        match mirror_once(&ctx, &client, &keys, &redis).await {
            Ok(pass) => {
                failing = false;
                let names =
                    |v: &[(String, String)]| v.iter().map(|(d, _)| d.clone()).collect::<Vec<_>>();
                if names(&pass.refused) != names(&refused) {
                    for (domain, why) in &pass.refused {
                        warn!(
                            domain,
                            why, "envoy domain not mirrored: its fence is another leader's"
                        );
                    }
                    if pass.refused.is_empty() {
                        info!("envoy mirror: no domain held by another leader any more");
                    }
                }
                refused = pass.refused;
            }
            Err(Error::NotLeader) => return,
            Err(e) => {
                if !failing {
                    warn!(%e, "envoy mirror pass failed; retrying");
                }
                failing = true;
            }
        }
        tokio::select! {
            _ = ctx.token().cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mirror scripts are `protocol/scripts/parts/mirror_fence.lua` followed by
    /// `parts/mirror_set.lua` / `parts/mirror_del.lua` (as docs/protocol.md says), and keep their SHA-1s: a change to either
    /// script must be deliberate (update the SHA-1 here with it).
    #[test]
    fn mirror_scripts_match_their_files() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../protocol/scripts/parts");
        let read = |name: &str| {
            let path = dir.join(format!("{name}.lua"));
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        };
        for (name, text, sha1) in [
            (
                "mirror_set",
                MIRROR_SET_LUA,
                "8cee122d76ea07c646e21f84ff08fc12ee80473b",
            ),
            (
                "mirror_del",
                MIRROR_DEL_LUA,
                "71bd4151d9392ab922aaee49b508227dcc9d5f44",
            ),
        ] {
            assert!(
                read("mirror_fence") + &read(name) == text,
                "{name}'s constant is not mirror_fence.lua followed by {name}.lua"
            );
            assert_eq!(Script::new(text).get_hash(), sha1, "{name}'s SHA-1 changed");
        }
    }

    const FULL: &str = "\
domain: shop
descriptors:
  - key: path
    value: checkout
    rate_limit:
      unit: second
      requests_per_unit: 50
      name: checkout
  - key: remote_address
    rate_limit:
      unit: minute
      requests_per_unit: 600
  - key: tenant
    value: acme
    descriptors:
      - key: plan
        value: gold
        rate_limit:
          unit: hour
          requests_per_unit: 7200
        shadow_mode: true
      - key: user
        rate_limit:
          unit: day
          requests_per_unit: 1000
          replaces:
            - name: checkout
  - key: internal
    rate_limit:
      unlimited: true
";

    fn err(text: &str) -> ImportError {
        prepare(text).expect_err("must be refused")
    }

    #[test]
    fn compiles_every_kind_of_node() {
        let c = prepare(FULL).unwrap();
        assert_eq!(c.domain, "shop");
        let t: Vec<(&str, u64, u64, bool, bool)> = c
            .tasks
            .iter()
            .map(|t| {
                (
                    t.name.as_str(),
                    t.spec.threshold,
                    t.spec.slice_ms,
                    t.spec.keyed,
                    t.spec.shadow,
                )
            })
            .collect();
        assert_eq!(
            t,
            vec![
                ("shop.path_checkout", 50, 1000, false, false),
                ("shop.remote_address", 600, 60_000, true, false),
                ("shop.tenant_acme.plan_gold", 7200, 3_600_000, false, true),
                ("shop.tenant_acme.user", 1000, 86_400_000, true, false),
            ]
        );
        assert_eq!(
            c.tasks[2].spec.description,
            "envoy-ratelimit shop: tenant=acme / plan=gold (line 16)"
        );
        assert_eq!(c.tasks[2].path, "tenant=acme / plan=gold");
        let tenant = &c.descriptors[2];
        assert_eq!(tenant["task"], Value::Null);
        assert_eq!(tenant["keyed"], false);
        assert_eq!(tenant["unit"], Value::Null);
        let user = &tenant["descriptors"][1];
        assert_eq!(user["task"], "shop.tenant_acme.user");
        assert_eq!(user["value"], Value::Null);
        assert_eq!(user["keyed"], true);
        assert_eq!(user["unit"], "day");
        assert_eq!(user["requests_per_unit"], 1000);
        assert_eq!(user["replaces"], json!(["checkout"]));
        assert_eq!(c.descriptors[0]["name"], "checkout");
        let internal = &c.descriptors[3];
        assert_eq!(internal["unlimited"], true);
        assert_eq!(internal["task"], Value::Null);
        assert_eq!(internal["requests_per_unit"], Value::Null);
        assert_eq!(tenant["descriptors"][0]["shadow"], true);
    }

    #[test]
    fn refusals_name_field_and_line() {
        let cases: &[(&str, &str, usize, &str)] = &[
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: week\n      requests_per_unit: 1\n",
                "descriptors[0].rate_limit.unit",
                5,
                "at most one day",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    value: foo\n    share_threshold: true\n",
                "descriptors[0].share_threshold",
                5,
                "needs a value with `*`",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    colour: red\n",
                "descriptors[0].colour",
                4,
                "unknown key",
            ),
            (
                "domain: d\ndescriptors:\n  - value: a\n",
                "descriptors[0].key",
                3,
                "required",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n",
                "descriptors[0].rate_limit.requests_per_unit",
                5,
                "required",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      requests_per_unit: -1\n      unit: second\n",
                "descriptors[0].rate_limit.requests_per_unit",
                5,
                "whole number",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    value: x\n  - key: b\n  - key: a\n    value: x\n",
                "descriptors[2]",
                6,
                "duplicate descriptor",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      name: me\n      unit: second\n      requests_per_unit: 1\n      replaces:\n        - name: me\n",
                "descriptors[0].rate_limit.replaces[0].name",
                9,
                "its own name",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      replaces:\n        - name: nope\n",
                "descriptors[0].rate_limit.replaces[0].name",
                8,
                "not the name",
            ),
            ("domain: a.b\n", "domain", 1, "A-Z"),
            ("descriptors: []\n", "domain", 1, "required"),
            (
                "domain: d\ndescriptors:\n  - key: a\n    shadow_mode: maybe\n",
                "descriptors[0].shadow_mode",
                4,
                "true or false",
            ),
            ("domain: d\n---\ndomain: e\n", "", 2, "one YAML document"),
            ("domain: d\ndescriptors: [\n", "", 3, "malformed YAML"),
            ("domain: d\ndomain: e\n", "domain", 2, "duplicate key"),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      unit: minute\n",
                "descriptors[0].rate_limit.unit",
                6,
                "duplicate key (first at line 5)",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unlimited: true\n      unit: second\n",
                "descriptors[0].rate_limit.unit",
                6,
                "unlimited",
            ),
        ];
        for (text, field, line, msg) in cases {
            let e = err(text);
            assert_eq!(e.field, *field, "{text}: {e:?}");
            assert_eq!(e.line, Some(*line), "{text}: {e:?}");
            assert!(e.error.contains(msg), "{text}: {e:?}");
        }
    }

    #[test]
    fn sizes_are_bounded() {
        let mut deep = String::from("domain: d\ndescriptors:\n");
        for i in 0..=MAX_DEPTH {
            let pad = "  ".repeat(2 * i);
            deep.push_str(&format!("{pad}  - key: k{i}\n{pad}    descriptors:\n"));
        }
        let e = err(&deep);
        assert!(e.error.contains("nested more than"), "{e:?}");

        let mut many = String::from("domain: d\ndescriptors:\n");
        for i in 0..=MAX_TASKS {
            many.push_str(&format!(
                "  - key: k{i}\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n"
            ));
        }
        let e = err(&many);
        assert!(e.error.contains("more than 60"), "{e:?}");

        // Alias bombs are bounded.
        let mut bomb = String::from("domain: d\na0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..8 {
            let p = i - 1;
            bomb.push_str(&format!(
                "a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"
            ));
        }
        let e = err(&bomb);
        assert!(e.error.contains("too large"), "{e:?}");
    }

    #[test]
    fn zero_is_a_block_list_and_aliases_work() {
        let c = prepare("domain: d\nlimit: &l {unit: second, requests_per_unit: 0}\n");
        // `limit` is not a key of a domain config.
        assert_eq!(c.unwrap_err().field, "limit");
        let c = prepare(
            "domain: d\ndescriptors:\n  - key: ip\n    value: 1.2.3.4\n    rate_limit: &block {unit: second, requests_per_unit: 0}\n  - key: ip\n    value: 5.6.7.8\n    rate_limit: *block\n",
        )
        .unwrap();
        assert_eq!(c.tasks.len(), 2);
        assert!(c.tasks.iter().all(|t| t.spec.threshold == 0));
        // Values with dots are not name parts: hashed names.
        assert!(c.tasks[0].name.starts_with("d.h"), "{}", c.tasks[0].name);
        assert_eq!(c.tasks[0].name.len(), "d.h".len() + 20);
    }

    #[test]
    fn names_follow_the_contract() {
        assert_eq!(
            task_name("shop", &[("a", Some("b")), ("c", None)]),
            "shop.a_b.c"
        );
        let h = task_name("shop", &[("path", Some("/x"))]);
        let d = digest::digest(&digest::SHA256, b"shop\npath=/x");
        let hex: String = d.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(h, format!("shop.h{}", &hex[..20]));
        let long = "k".repeat(70);
        assert!(task_name("shop", &[(&long, None)]).starts_with("shop.h"));
        // Colliding readable names fall back to hashes.
        let c = prepare(
            "domain: d\ndescriptors:\n  - key: a_b\n    value: c\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: a\n    value: b_c\n    rate_limit: {unit: second, requests_per_unit: 2}\n",
        )
        .unwrap();
        assert_ne!(c.tasks[0].name, c.tasks[1].name);
        assert!(c.tasks.iter().all(|t| t.name.starts_with("d.h")));
    }

    #[test]
    fn empty_values_and_nulls_are_wildcards_and_quoted_text_is_text() {
        let c = prepare(
            "domain: d\ndescriptors:\n  - key: a\n    value: ~\n    rate_limit: {unit: Second, requests_per_unit: 3}\n  - key: b\n    value: \"null\"\n    rate_limit: {unit: MINUTE, requests_per_unit: 3}\n",
        )
        .unwrap();
        assert!(c.tasks[0].spec.keyed);
        assert!(!c.tasks[1].spec.keyed);
        assert_eq!(c.tasks[1].name, "d.b_null");
        assert_eq!(c.tasks[1].spec.slice_ms, 60_000);
    }
}
