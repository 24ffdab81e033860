//! The SDK's quick example is written once, as code that compiles: the region between
//! `// quickstart:begin` and `// quickstart:end` of `worker-sdk/examples/quickstart.rs` (built
//! by `cargo build --examples`). docs/sdk.md ("Ten lines"), the crate docs (`src/lib.rs`) and
//! the crate README (`worker-sdk/README.md`; both doctests) show the same text; these tests
//! fail when one differs from the example, and print the text to paste. No servers needed.

use std::path::Path;

fn read(rel: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()))
}

/// The example's marked region, dedented by the marker's indentation.
fn example_region() -> Vec<String> {
    let text = read("worker-sdk/examples/quickstart.rs");
    let lines: Vec<&str> = text.lines().collect();
    let find = |marker: &str| {
        let found: Vec<usize> = (0..lines.len())
            .filter(|&i| lines[i].trim() == marker)
            .collect();
        assert_eq!(
            found.len(),
            1,
            "worker-sdk/examples/quickstart.rs must have exactly one line `{marker}`"
        );
        found[0]
    };
    let (b, e) = (find("// quickstart:begin"), find("// quickstart:end"));
    assert!(b < e, "quickstart:begin after quickstart:end");
    let indent = lines[b].len() - lines[b].trim_start().len();
    let region: Vec<String> = lines[b + 1..e]
        .iter()
        .map(|l| {
            assert!(
                l.trim().is_empty() || l[..indent.min(l.len())].trim().is_empty(),
                "line less indented than its marker: {l:?}"
            );
            l.get(indent..).unwrap_or("").trim_end().to_string()
        })
        .collect();
    assert!(
        region.iter().any(|l| l.contains("try_acquire")),
        "the region is not the quick example"
    );
    region
}

fn assert_same(place: &str, shown: &[String], region: &[String]) {
    if shown != region {
        let first = shown
            .iter()
            .zip(region)
            .position(|(a, b)| a != b)
            .unwrap_or(shown.len().min(region.len()));
        panic!(
            "{place} differs from worker-sdk/examples/quickstart.rs at line {} of the snippet:\n  \
             shown:   {:?}\n  example: {:?}\nThe example's text is:\n{}",
            first + 1,
            shown.get(first),
            region.get(first),
            region.join("\n")
        );
    }
}

#[test]
fn sdk_md_ten_lines_are_the_quickstart_example() {
    let md = read("docs/sdk.md");
    let lines: Vec<&str> = md.lines().collect();
    let marker = lines
        .iter()
        .position(|l| l.starts_with("<!-- quickstart:"))
        .expect("docs/sdk.md: no `<!-- quickstart: … -->` marker before the Ten lines block");
    assert_eq!(
        lines.get(marker + 1).copied(),
        Some("```rust"),
        "docs/sdk.md: the marker must be followed by a ```rust block"
    );
    let end = lines[marker + 2..]
        .iter()
        .position(|l| *l == "```")
        .expect("docs/sdk.md: unterminated quickstart block")
        + marker
        + 2;
    let shown: Vec<String> = lines[marker + 2..end]
        .iter()
        .map(|l| l.trim_end().to_string())
        .collect();
    assert_same("docs/sdk.md (Ten lines)", &shown, &example_region());
}

/// The lines of the first code block opened by `opener`, without a doctest's hidden (`# `)
/// lines.
fn code_block(place: &str, lines: &[&str], opener: &str) -> Vec<String> {
    let open = lines
        .iter()
        .position(|l| l.starts_with("```"))
        .unwrap_or_else(|| panic!("{place}: no code block"));
    assert_eq!(
        lines[open], opener,
        "{place}: the first code block must be `{opener}` (a doctest, compiled, not run)"
    );
    let close = lines[open + 1..]
        .iter()
        .position(|l| *l == "```")
        .unwrap_or_else(|| panic!("{place}: unterminated code block"))
        + open
        + 1;
    lines[open + 1..close]
        .iter()
        .filter(|l| !(l.starts_with("# ") || **l == "#"))
        .map(|l| l.trim_end().to_string())
        .collect()
}

#[test]
fn crate_readme_example_is_the_quickstart_example() {
    let readme = read("worker-sdk/README.md");
    // The first Rust block (the TOML block before it is the dependency line).
    let lines: Vec<&str> = readme.lines().collect();
    let from = lines
        .iter()
        .position(|l| l.starts_with("```rust"))
        .expect("worker-sdk/README.md: no Rust code block");
    let shown = code_block("worker-sdk/README.md", &lines[from..], "```rust,no_run");
    assert_same("worker-sdk/README.md", &shown, &example_region());
}

#[test]
fn crate_docs_example_is_the_quickstart_example() {
    let lib = read("worker-sdk/src/lib.rs");
    // The crate docs' first code block, without the doctest's hidden (`# `) lines.
    let doc: Vec<&str> = lib
        .lines()
        .take_while(|l| l.starts_with("//!") || l.trim().is_empty())
        .map(|l| l.strip_prefix("//!").unwrap_or(""))
        .map(|l| l.strip_prefix(' ').unwrap_or(l))
        .collect();
    let shown = code_block("src/lib.rs (crate docs)", &doc, "```no_run");
    assert_same("src/lib.rs (crate docs)", &shown, &example_region());
}
