//! The script files for implementers in other languages, and their SHA-1s.
//!
//! `protocol/scripts/` holds the only copy of the Lua text: each script constant is built from
//! its files with `include_str!` (see the module docs of `scripts`), a whole script from one file, a
//! composed one from a shared fragment and its body, both in `protocol/scripts/parts/`. These tests pin what other languages rely
//! on: which files a script is the concatenation of (as `docs/protocol.md` states it), and
//! `protocol/scripts/SHA1SUMS`, the SHA-1 of each script as sent (so `SCRIPT LOAD` of the
//! composed text gives the SHA-1 of the Rust SDK's `EVALSHA`; `sha1sum -c` format). A change to
//! a script changes its SHA-1; rewrite SHA1SUMS with
//!
//! ```text
//! SLUICE_WRITE_SCRIPTS=1 cargo test -p sluice-protocol shipped_scripts
//! ```
//!
//! (the manager's own scripts, `parts/mirror_fence.lua` + `parts/mirror_set.lua` /
//! `parts/mirror_del.lua`, live in the same folder and are checked by `cargo test -p sluice-manager mirror_scripts`).

use std::path::{Path, PathBuf};

use super::*;
use crate::lease::{LEASE_LUA, LOCK_ACQUIRE_LUA, LOCK_RELEASE_LUA, LOCK_RENEW_LUA};

/// Every script the SDK sends (workers) or the manager sends through this crate (leader), by
/// the name SHA1SUMS lists it under, with the files (without `.lua`) it is the concatenation of.
const SHIPPED: &[(&str, &str, &[&str])] = &[
    (
        "pull",
        PULL_LUA,
        &["parts/pace", "parts/lazy", "parts/pull"],
    ),
    ("kpull", KPULL_LUA, &["kpull"]),
    ("flush", FLUSH_LUA, &["flush"]),
    ("take", TAKE_LUA, &["parts/lazy", "parts/take"]),
    ("slide", SLIDE_LUA, &["parts/lazy", "parts/slide"]),
    ("lease", LEASE_LUA, &["lease"]),
    ("lock_acquire", LOCK_ACQUIRE_LUA, &["lock_acquire"]),
    ("lock_renew", LOCK_RENEW_LUA, &["lock_renew"]),
    ("lock_release", LOCK_RELEASE_LUA, &["lock_release"]),
    ("roll", ROLL_LUA, &["parts/fence", "parts/roll"]),
    ("retire", RETIRE_LUA, &["parts/fence", "parts/retire"]),
    ("adjust", ADJUST_LUA, &["parts/fence", "parts/adjust"]),
    (
        "record_history",
        RECORD_HISTORY_LUA,
        &["parts/fence", "parts/record_history"],
    ),
    ("read_slices", READ_SLICES_LUA, &["read_slices"]),
    ("prune_hosts", PRUNE_HOSTS_LUA, &["prune_hosts"]),
];

/// In the same folder, owned (and checked) by the manager crate.
const MANAGER_OWNED: &[&str] = &["parts/mirror_fence", "parts/mirror_set", "parts/mirror_del"];

const REGENERATE: &str = "after a deliberate change of a script, regenerate SHA1SUMS with \
                          `SLUICE_WRITE_SCRIPTS=1 cargo test -p sluice-protocol \
                          shipped_scripts` and commit it";

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts")
}

fn writing() -> bool {
    std::env::var_os("SLUICE_WRITE_SCRIPTS").is_some_and(|v| v == "1")
}

fn sha1sums() -> String {
    SHIPPED
        .iter()
        .map(|(name, text, _)| format!("{}  {name}.lua\n", Script::new(text).get_hash()))
        .collect()
}

#[test]
fn shipped_scripts_match_their_constants() {
    let dir = dir();
    let mut stale = Vec::new();
    for (name, text, parts) in SHIPPED {
        let mut have = String::new();
        for part in *parts {
            let path = dir.join(format!("{part}.lua"));
            match std::fs::read_to_string(&path) {
                Ok(t) => have.push_str(&t),
                Err(e) => stale.push(format!("{}: {e}", path.display())),
            }
        }
        if have != *text {
            stale.push(format!(
                "{name}'s constant is not the concatenation of {parts:?}"
            ));
        }
    }
    let path = dir.join("SHA1SUMS");
    if writing() {
        std::fs::write(&path, sha1sums())
            .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    }
    match std::fs::read_to_string(&path) {
        Ok(have) if have == sha1sums() => {}
        Ok(_) => stale.push(format!(
            "{} differs from the SHA-1s of the constants; {REGENERATE}",
            path.display()
        )),
        Err(e) => stale.push(format!("{}: {e}; {REGENERATE}", path.display())),
    }
    assert!(stale.is_empty(), "{}", stale.join("; "));
}

#[test]
fn shipped_scripts_folder_has_no_unknown_script() {
    let listed: Vec<String> = SHIPPED
        .iter()
        .flat_map(|(_, _, parts)| parts.iter().copied())
        .chain(MANAGER_OWNED.iter().copied())
        .map(|n| format!("{n}.lua"))
        .collect();
    for (sub, prefix) in [(dir(), ""), (dir().join("parts"), "parts/")] {
        let Ok(entries) = std::fs::read_dir(&sub) else {
            panic!("{} is missing", sub.display());
        };
        for e in entries {
            let name = e.expect("a folder entry").file_name();
            let name = format!("{prefix}{}", name.to_string_lossy());
            if name.ends_with(".lua") {
                assert!(
                    listed.contains(&name),
                    "protocol/scripts/{name} is part of no script constant: delete it, or list \
                     it in protocol/src/shipped_scripts.rs"
                );
            }
        }
    }
}

/// Every `.lua` file directly in `protocol/scripts/` is a whole script, loadable as it is (so
/// `sha1sum -c --ignore-missing SHA1SUMS` there checks each of them); the pieces composed
/// scripts are made of are in `parts/`, never loaded alone (review of issue 24: a body beside
/// the whole scripts could be mistaken for one).
#[test]
fn whole_scripts_are_files_and_pieces_are_parts() {
    for (name, _, parts) in SHIPPED {
        match parts {
            [one] => assert_eq!(*one, *name, "{name}: a whole script is its own file"),
            _ => assert!(
                parts.iter().all(|p| p.starts_with("parts/")),
                "{name}: the pieces of a composed script belong in parts/"
            ),
        }
    }
    assert!(MANAGER_OWNED.iter().all(|p| p.starts_with("parts/")));
}

#[test]
fn shipped_scripts_names_are_unique() {
    let mut names: Vec<&str> = SHIPPED.iter().map(|(n, _, _)| *n).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), SHIPPED.len());
}
