#!/usr/bin/env python3
"""The worker SDK's import graph, by top-level module (a file under worker-sdk/src, or a folder
counted as one), from its non-test code: every `crate::<module>` path and every `crate::<Name>`
re-exported by lib.rs. Prints the modules in an order where each imports only modules printed
before it and every circle, then checks the layers of docs/architecture.md (LAYERS below): an
import of a module of the same or a higher layer runs back up. Exits 1 on a circle, an import
that runs back up, or a module no layer names.

    scripts/sdk-imports.py [--edges]
    scripts/sdk-imports.py --self-test   # plants upward imports in a copy; each must be caught
"""

import re
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "worker-sdk" / "src"

# The layers of docs/architecture.md ("The SDK's modules"), lowest first: a module imports
# only modules of lower layers (never one of its own layer or above).
LAYERS = [
    ["clock"],
    ["shm"],
    ["state", "health", "pull", "limiter", "error", "keytable"],
    ["config", "decision"],
    ["ctx", "decide"],
    ["plumbing"],
    ["refill"],
    ["background"],
    ["client"],
    ["keyed", "concurrency"],
    ["multi", "lock", "layer"],
]
LAYER = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def module_of(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".rs")


def strip_literals(text: str) -> str:
    """The text with comments removed and string and char literals emptied (newlines kept),
    so braces and paths inside them are not read as code."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        nxt = text[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            while i < n and text[i] != "\n":
                i += 1
        elif c == "/" and nxt == "*":
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    out.append("\n" if text[i] == "\n" else "")
                    i += 1
        elif c in "rb" and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")) and (
            m := re.match(r'b?r(#*)"', text[i:])
        ):
            end = text.find('"' + m.group(1), i + m.end())
            end = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                if text[i] == "\n":
                    out.append("\n")
                i += 2 if text[i] == "\\" else 1
            out.append('""')
            i += 1
        elif c == "'" and nxt == "\\":
            end = text.find("'", i + 2)
            out.append("' '")
            i = n if end < 0 else end + 1
        elif c == "'" and i + 2 < n and text[i + 2] == "'":
            out.append("' '")
            i += 3
        else:
            out.append(c)
            i += 1
    return "".join(out)


def code_lines(text: str):
    """Non-test lines of code (a `#[cfg(test)]` or `#[cfg(doc)]` item is skipped), with
    comments and literals removed."""
    lines = strip_literals(text).split("\n")
    skip_next_item = False
    depth_skip = None
    depth = 0
    for line in lines:
        s = line.strip()
        if depth_skip is not None:
            depth += line.count("{") - line.count("}")
            if depth <= depth_skip and ("}" in line or s.endswith(";")):
                depth_skip = None
            continue
        if s in ("#[cfg(test)]", "#[cfg(doc)]"):
            skip_next_item = True
            continue
        if skip_next_item:
            if s.startswith("#[") or not s:
                continue
            skip_next_item = False
            if s.endswith(";"):
                continue
            depth_skip = depth
            depth += line.count("{") - line.count("}")
            if depth <= depth_skip:
                depth_skip = None
            continue
        depth += line.count("{") - line.count("}")
        yield line


def module_path(path: Path) -> list:
    """The module path of a file: `decide/pooled.rs` -> [decide, pooled]."""
    parts = list(path.relative_to(SRC).parts)
    last = parts.pop()
    return parts if last == "mod.rs" else parts + [last.removesuffix(".rs")]


def root_names(modules):
    """`Name` -> module for lib.rs's `pub use module::{...}` re-exports."""
    lib = (SRC / "lib.rs").read_text()
    names = {}
    for m in re.finditer(r"pub use (\w+)::(\{[^}]*\}|\w+);", lib):
        mod, items = m.group(1), m.group(2)
        if mod not in modules:
            continue
        for name in re.findall(r"\w+", items):
            names[name] = mod
    return names


def graph():
    files = [p for p in SRC.rglob("*.rs") if p.name != "lib.rs"]
    modules = sorted({module_of(p) for p in files})
    names = root_names(set(modules))
    edges = {}
    for p in files:
        a = module_of(p)
        code = "\n".join(code_lines(p.read_text()))
        # `super::` as far as the crate root is `crate::` (`super::super::x` in
        # `decide/pooled.rs`, `super::x` in a top-level file).
        depth = len(module_path(p))
        code = re.sub(r"\b(?:super::){%d,}" % depth, "crate::", code)
        # `use crate::{a::X, b::{Y, Z}, Name}` groups: expand the first level.
        targets = set(re.findall(r"crate::(\w+)", code))
        for group in re.findall(r"crate::\{([^;]*)\}", code):
            targets.update(re.findall(r"(?:^|[,{]\s*)(\w+)", group))
        for t in targets:
            b = t if t in modules else names.get(t)
            if b and b != a:
                edges.setdefault((a, b), set()).add(str(p.relative_to(SRC)))
    return modules, edges


def sccs(modules, edges):
    adj = {m: sorted(b for (a, b) in edges if a == m) for m in modules}
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for m in modules:
        if m not in index:
            visit(m)
    return out  # reverse topological: a component's imports come before it


def check() -> tuple:
    """(circles, imports that run back up, modules in no layer) of the tree at SRC."""
    modules, edges = graph()
    comps = sccs(modules, edges)
    circles = [c for c in comps if len(c) > 1]
    back = sorted(
        (a, b) for (a, b) in edges if a in LAYER and b in LAYER and LAYER[b] >= LAYER[a]
    )
    unknown = [m for m in modules if m not in LAYER]
    return circles, back, unknown


def self_test() -> int:
    """Copies the SDK's sources, plants one upward import at a time in each way the reader
    must see through, and checks that each is caught (and that the clean copy passes)."""
    import shutil
    import tempfile

    global SRC
    real = SRC
    plants = {
        "a crate:: path": ("decide/pooled.rs", "use crate::client::Task as _T;\n"),
        "a group": ("decide/pooled.rs", "use crate::{clock, client::Task as _T};\n"),
        "super::super": (
            "decide/pooled.rs",
            "fn _x(_: &super::super::client::Task) {}\n",
        ),
        "super:: in a top-level file": ("plumbing.rs", "use super::client::Task as _T;\n"),
        "code after a test item holding a brace in a char": (
            "decide/pooled.rs",
            "#[cfg(test)]\nfn _b() -> char {\n    '{'\n}\nuse crate::client::Task as _T;\n",
        ),
        "code after a test item holding braces in a string": (
            "decide/pooled.rs",
            '#[cfg(test)]\nfn _s() -> &\'static str {\n    "{{"\n}\nuse crate::client::Task as _T;\n',
        ),
        "a core importing ctx": ("decide/pooled.rs", "use crate::ctx::Shared as _S;\n"),
        "a new module in no layer": ("newmod.rs", "use crate::clock as _c;\n"),
    }
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, (file, code) in [("clean copy", (None, None))] + list(plants.items()):
            dst = Path(tmp) / "src"
            if dst.exists():
                shutil.rmtree(dst)
            shutil.copytree(real, dst)
            if file:
                with open(dst / file, "a") as f:
                    f.write("\n" + code)
            SRC = dst
            circles, back, unknown = check()
            caught = bool(circles or back or unknown)
            ok = caught == (file is not None)
            failed += not ok
            print(f"  {'ok' if ok else 'FAILED'}: {name}: {'caught' if caught else 'passes'}")
    SRC = real
    return 1 if failed else 0


def main():
    if "--self-test" in sys.argv:
        return self_test()
    modules, edges = graph()
    comps = sccs(modules, edges)
    circles, back, unknown = check()
    print("order (each imports only modules before it):")
    print("  " + " < ".join("{" + ", ".join(c) + "}" if len(c) > 1 else c[0] for c in comps))
    print(f"modules: {len(modules)}, imports: {len(edges)}, running back up: {len(back)}")
    for a, b in back:
        print(f"  back up: {a} -> {b}  ({', '.join(sorted(edges[(a, b)]))})")
    for m in unknown:
        print(f"  in no layer: {m} (add it to LAYERS and to docs/architecture.md)")
    if "--edges" in sys.argv:
        for (a, b) in sorted(edges):
            print(f"  {a} -> {b}")
    for c in circles:
        print("circle: " + ", ".join(c))
    if circles or back or unknown:
        return 1
    print("no circle, nothing runs back up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
