#!/usr/bin/env python3
"""The worker SDK's import graph, by top-level module (a file under worker-sdk/src, or a folder
counted as one), from its non-test code: every `crate::<module>` path and every `crate::<Name>`
re-exported by lib.rs. Prints the modules in an order where each imports only modules printed
before it and every circle, then checks the layers of docs/architecture.md (LAYERS below): an
import of a module of the same or a higher layer runs back up. Exits 1 on a circle, an import
that runs back up, or a module no layer names.

    scripts/sdk-imports.py [--edges]
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
    ["ctx"],
    ["decide"],
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


def code_lines(text: str):
    """Non-test, non-comment lines (a `#[cfg(test)]` or `#[cfg(doc)]` item is skipped)."""
    lines = text.split("\n")
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
            skip_next_item = False
            if s.endswith(";"):
                continue
            depth_skip = depth
            depth += line.count("{") - line.count("}")
            if depth <= depth_skip:
                depth_skip = None
            continue
        if s.startswith("//"):
            continue
        depth += line.count("{") - line.count("}")
        yield line


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


def main():
    modules, edges = graph()
    comps = sccs(modules, edges)
    circles = [c for c in comps if len(c) > 1]
    print("order (each imports only modules before it):")
    print("  " + " < ".join("{" + ", ".join(c) + "}" if len(c) > 1 else c[0] for c in comps))
    unknown = [m for m in modules if m not in LAYER]
    back = sorted(
        (a, b) for (a, b) in edges if a in LAYER and b in LAYER and LAYER[b] >= LAYER[a]
    )
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
