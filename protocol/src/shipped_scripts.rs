//! The script texts shipped as files for implementers in other languages.
//!
//! `docs/protocol/scripts/<name>.lua` holds, byte for byte, the text of each script constant
//! the SDK and the manager send (so `SCRIPT LOAD` of a file gives the same SHA-1 as the Rust
//! SDK's `EVALSHA`), and `docs/protocol/scripts/SHA1SUMS` their SHA-1s (`sha1sum -c` format).
//! These tests fail when a file differs from its constant; regenerate the files with
//!
//! ```text
//! SLUICE_WRITE_SCRIPTS=1 cargo test -p sluice-protocol shipped_scripts
//! ```
//!
//! (the manager's own two scripts, `mirror_set.lua` and `mirror_del.lua`, are checked and
//! rewritten the same way by `cargo test -p sluice-manager shipped_scripts`).

use std::path::{Path, PathBuf};

use super::*;
use crate::lease::{LEASE_LUA, LOCK_ACQUIRE_LUA, LOCK_RELEASE_LUA, LOCK_RENEW_LUA};

/// Every script the SDK sends (workers) or the manager sends through this crate (leader), by
/// the file name it is shipped under.
const SHIPPED: &[(&str, &str)] = &[
    ("pull", PULL_LUA),
    ("kpull", KPULL_LUA),
    ("flush", FLUSH_LUA),
    ("take", TAKE_LUA),
    ("slide", SLIDE_LUA),
    ("lease", LEASE_LUA),
    ("lock_acquire", LOCK_ACQUIRE_LUA),
    ("lock_renew", LOCK_RENEW_LUA),
    ("lock_release", LOCK_RELEASE_LUA),
    ("roll", ROLL_LUA),
    ("retire", RETIRE_LUA),
    ("adjust", ADJUST_LUA),
    ("record_history", RECORD_HISTORY_LUA),
    ("read_slices", READ_SLICES_LUA),
    ("prune_hosts", PRUNE_HOSTS_LUA),
];

/// Shipped in the same folder, owned (and checked) by the manager crate.
const MANAGER_OWNED: &[&str] = &["mirror_set", "mirror_del"];

const REGENERATE: &str = "regenerate with `SLUICE_WRITE_SCRIPTS=1 cargo test -p sluice-protocol \
                          shipped_scripts` and commit the files";

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/protocol/scripts")
}

fn writing() -> bool {
    std::env::var_os("SLUICE_WRITE_SCRIPTS").is_some_and(|v| v == "1")
}

fn sha1sums() -> String {
    SHIPPED
        .iter()
        .map(|(name, text)| format!("{}  {name}.lua\n", Script::new(text).get_hash()))
        .collect()
}

fn check(path: &Path, want: &str, stale: &mut Vec<String>) {
    if writing() {
        std::fs::create_dir_all(path.parent().expect("a folder")).expect("create the folder");
        std::fs::write(path, want).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    }
    match std::fs::read_to_string(path) {
        Ok(have) if have == want => {}
        Ok(_) => stale.push(format!("{} differs from its constant", path.display())),
        Err(e) => stale.push(format!("{}: {e}", path.display())),
    }
}

#[test]
fn shipped_scripts_match_their_constants() {
    let dir = dir();
    let mut stale = Vec::new();
    for (name, text) in SHIPPED {
        check(&dir.join(format!("{name}.lua")), text, &mut stale);
    }
    check(&dir.join("SHA1SUMS"), &sha1sums(), &mut stale);
    assert!(stale.is_empty(), "{}; {REGENERATE}", stale.join("; "));
}

#[test]
fn shipped_scripts_folder_has_no_unknown_script() {
    let listed: Vec<String> = SHIPPED
        .iter()
        .map(|(n, _)| *n)
        .chain(MANAGER_OWNED.iter().copied())
        .map(|n| format!("{n}.lua"))
        .collect();
    if writing() {
        std::fs::create_dir_all(dir()).expect("create the folder");
    }
    let Ok(entries) = std::fs::read_dir(dir()) else {
        panic!("{} is missing; {REGENERATE}", dir().display());
    };
    for e in entries {
        let name = e.expect("a folder entry").file_name();
        let name = name.to_string_lossy();
        if name.ends_with(".lua") {
            assert!(
                listed.iter().any(|l| *l == name),
                "docs/protocol/scripts/{name} is no script constant any more: delete it, or \
                 list its constant in protocol/src/shipped_scripts.rs"
            );
        }
    }
}

#[test]
fn shipped_scripts_names_are_unique() {
    let mut names: Vec<&str> = SHIPPED.iter().map(|(n, _)| *n).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), SHIPPED.len());
}
