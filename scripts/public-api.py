#!/usr/bin/env python3
"""The public API of the SDK (`sluice`), hidden items included, as sorted text lines: one per item
reachable by a public path and one per public method, field and variant, with its signature
(ids, spans and internal defining paths removed), so two revisions diff cleanly. An equivalent
of `cargo public-api` from the toolchain's nightly rustdoc JSON (not run by scripts/test.sh):

    CARGO_TARGET_DIR=/tmp/api cargo +nightly rustdoc -p sluice-sdk --lib --features tower -- \
        -Z unstable-options --output-format json --document-hidden-items
    scripts/public-api.py /tmp/api/doc/sluice.json > after.txt   # the same at the other revision
    diff before.txt after.txt
"""
import json, re, sys
d = json.load(open(sys.argv[1]))
idx = d["index"]; paths = d["paths"]
def clean(x):
    if isinstance(x, dict) and "tuple" in x and isinstance(x["tuple"], list) and all(isinstance(i, int) or i is None for i in x["tuple"]):
        x = dict(x); x["tuple"] = [clean(idx[str(i)]["inner"]) if i is not None and str(i) in idx else None for i in x["tuple"]]
    if isinstance(x, dict):
        return {k: (re.sub(r"^crate::(\w+::)*", "crate::", v) if k == "path" and isinstance(v, str) else clean(v)) for k, v in sorted(x.items()) if k not in ("id", "span", "docs", "links", "crate_id", "attrs", "impls", "fields", "variants", "items", "implementations")}
    if isinstance(x, list):
        return [clean(v) for v in x]
    return x
out = set()
def walk(item_id, path, depth=0):
    it = idx.get(str(item_id))
    if it is None or depth > 6:
        return
    inner = it["inner"]
    kind = next(iter(inner))
    name = it.get("name")
    p = path + ([name] if name else [])
    if kind == "module":
        for c in inner["module"]["items"]:
            walk(c, p, depth+1)
        return
    if kind == "use":
        u = inner["use"]
        tgt = u.get("id")
        if it.get("visibility") != "public":
            return
        if tgt is not None and str(tgt) in idx:
            t = idx[str(tgt)]
            if u.get("is_glob"):
                if "module" in t["inner"]:
                    for c in t["inner"]["module"]["items"]:
                        walk(c, path, depth+1)
                return
            # re-export under its name
            t2 = dict(t); t2["name"] = u["name"]
            idx["_tmp%d" % depth] = t2
            walk("_tmp%d" % depth, path, depth+1)
        else:
            out.add("::".join(path + [u["name"]]) + " = use " + u["source"])
        return
    if it.get("visibility") != "public" and kind not in ("impl",):
        return
    sig = json.dumps(clean(inner), sort_keys=True)
    out.add("::".join(p) + " " + kind + " " + sig[:4000])
    # members
    body = inner[kind]
    members = []
    if isinstance(body, dict):
        for key in ("impls",):
            for im in body.get(key, []) or []:
                imp = idx.get(str(im))
                if imp and not imp["inner"]["impl"].get("is_synthetic") and imp["inner"]["impl"].get("blanket_impl") is None:
                    tr = imp["inner"]["impl"].get("trait")
                    trn = tr["path"] if tr else ""
                    out.add("::".join(p) + " impl " + trn)
                    for m in imp["inner"]["impl"]["items"]:
                        mi = idx.get(str(m))
                        if mi and (mi.get("visibility") == "public" or tr):
                            out.add("::".join(p) + "::" + str(mi.get("name")) + " " + json.dumps(clean(mi["inner"]), sort_keys=True)[:4000])
        if kind == "struct":
            k = body.get("kind", {})
            fields = k.get("plain", {}).get("fields", []) if isinstance(k, dict) else []
            for f in fields:
                fi = idx.get(str(f))
                if fi and fi.get("visibility") == "public":
                    out.add("::".join(p) + "." + fi["name"] + " " + json.dumps(clean(fi["inner"]), sort_keys=True))
        if kind == "enum":
            for v in body.get("variants", []):
                vi = idx.get(str(v))
                if vi:
                    out.add("::".join(p) + "::" + vi["name"] + " " + json.dumps(clean(vi["inner"]), sort_keys=True))
walk(d["root"], [])
for l in sorted(out):
    print(l)
