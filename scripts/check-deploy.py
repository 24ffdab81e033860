#!/usr/bin/env python3
"""Cross-checks of the deployment kit that no off-the-shelf validator makes (run by
scripts/check-deploy.sh with PyYAML installed; Python >= 3.11 for tomllib).

    check-deploy.py metrics            the metric names the code exports, one a line
    check-deploy.py grafana FILE       dashboard JSON parses; every sluice_* name is exported
    check-deploy.py rules FILE         every sluice_* name of the alert rules is exported
    check-deploy.py k8s FILE...        probes, ports, selectors, mounts, env names, TOML keys,
                                       listeners and tokens, network policies
    check-deploy.py compose FILE       services, depends_on, volumes, ports, env names, secrets,
                                       listeners and tokens
    check-deploy.py env FILE...        systemd environment files: syntax and env names
    check-deploy.py toml FILE...       example TOML configs: keys the binaries accept, listeners
                                       and tokens

"Listeners and tokens": a configuration that puts a listener beyond loopback also gives the
binary a token (or says insecure_listen), else the binary refuses to start. "Network
policies": every pod template is selected by a NetworkPolicy of type Ingress, every ingress
rule names its sources (`from`) and its ports, and every named port exists on the pods.

Names "the code exports" are read from manager/src/metrics.rs and agent/src/metrics.rs (every
registry.register call, its prefix and its type: a counter gets _total, a histogram _bucket,
_sum and _count); env names and TOML keys from the clap definitions in */src/config.rs.
Every problem is printed as `FILE: what` and makes the exit code 1.
"""

import ipaddress
import json
import re
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
problems: list[str] = []


def bad(where: str, what: str) -> None:
    problems.append(f"{where}: {what}")


# ---------------------------------------------------------------- what the code exports

REGISTER = re.compile(
    r'registry\.register\(\s*"([a-z0-9_]+)",\s*"(?:[^"\\]|\\.)*",\s*(?:m\.)?([a-z0-9_]+)\.clone\(\)',
    re.S,
)


def metric_kind(type_text: str) -> str:
    for kind in ("Histogram", "Counter", "Gauge"):
        if kind in type_text:
            return kind
    raise SystemExit(f"unknown metric type {type_text!r}")


def exported_metrics() -> set[str]:
    names: set[str] = set()
    for rel in ("manager/src/metrics.rs", "agent/src/metrics.rs"):
        src = (ROOT / rel).read_text()
        prefix = re.search(r'Registry::with_prefix\("([a-z_]+)"\)', src)
        if not prefix:
            raise SystemExit(f"{rel}: no Registry::with_prefix: update check-deploy.py")
        found = REGISTER.findall(src)
        if len(found) < 5:
            raise SystemExit(f"{rel}: found {len(found)} registrations: update check-deploy.py")
        for name, ident in found:
            field = re.search(rf"pub {ident}: ([^\n]+),", src) or re.search(
                rf"let {ident} = ([^\n]+)", src
            )
            if not field:
                raise SystemExit(f"{rel}: cannot find the type of {ident}")
            full = f"{prefix.group(1)}_{name}"
            kind = metric_kind(field.group(1))
            if kind == "Counter":
                names.add(full + "_total")
            elif kind == "Histogram":
                names.update(full + s for s in ("_bucket", "_sum", "_count"))
            else:
                names.add(full)
    return names


# What `redis_env!` appends to a binary's prefix (protocol/src/flags.rs).
REDIS_ENV_SUFFIXES = re.findall(
    r'concat!\(\$prefix, "([A-Z_]+)"\)', (ROOT / "protocol/src/flags.rs").read_text()
)
if len(REDIS_ENV_SUFFIXES) != 7:
    raise SystemExit("protocol/src/flags.rs: the redis_env! names moved: update check-deploy.py")


def env_names() -> dict[str, set[str]]:
    """SLUICE_* names each binary reads, by binary (manager, agent)."""
    out = {}
    for binary in ("manager", "agent"):
        src = (ROOT / binary / "src/config.rs").read_text()
        out[binary] = set(re.findall(r'env = "(SLUICE_[A-Z0-9_]+)"', src))
        # The Redis flags are sluice_protocol::flags::RedisArgs, named from a prefix by
        # `redis_env!(… = "SLUICE_…")` in the binary's config.rs.
        for prefix in re.findall(
            r'redis_env!\((?:\s*(?://[^\n]*|#\[[^\]]*\]))*\s*(?:pub\s+)?\w+\s*=\s*"(SLUICE_[A-Z_]*)"', src
        ):
            out[binary].update(prefix + suffix for suffix in REDIS_ENV_SUFFIXES)
        if len(out[binary]) < 5:
            raise SystemExit(f"{binary}/src/config.rs: no env names found: update check-deploy.py")
    # Read from the environment by the manager without a flag (docs/operations.md).
    out["manager"].add("SLUICE_ETCD_PASSWORD")
    return out


ENV = env_names()
KNOWN_ENV = ENV["manager"] | ENV["agent"] | {"RUST_LOG", "SSL_CERT_FILE"}


def toml_keys(binary: str) -> set[str]:
    prefix = "SLUICE_AGENT_" if binary == "agent" else "SLUICE_"
    return {
        n[len(prefix):].lower()
        for n in ENV[binary]
        if n.startswith(prefix) and n not in (prefix + "CONFIG", "SLUICE_ETCD_PASSWORD")
    }


def check_env_name(where: str, name: str) -> None:
    if name.startswith("SLUICE_") and name not in KNOWN_ENV:
        bad(where, f"environment variable {name} is read by neither binary")


def check_toml(where: str, text: str, binary: str) -> None:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        bad(where, f"TOML does not parse: {e}")
        return
    for key in doc:
        if key not in toml_keys(binary):
            bad(where, f"key {key!r} is not a setting of sluice-{binary}")


# Listener settings (TOML names) of each binary and their defaults (docs/operations.md,
# docs/agent.md).
LISTENERS = {"manager": {"listen": "127.0.0.1:8080"},
             "agent": {"grpc_listen": "127.0.0.1:8081", "http_listen": "127.0.0.1:8082"}}


def is_loopback(addr: str) -> bool:
    host = str(addr).rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # the binaries take IP addresses only: not loopback, and refused anyway


def truthy(v) -> bool:
    return v is True or str(v).lower() in ("true", "1", "yes", "on")


def check_listeners(where: str, binary: str, settings: dict) -> None:
    """`settings`: TOML-style keys (listen, api_token_file, …) → values, as the binary sees them."""
    if settings.get("api_token") or settings.get("api_token_file") or truthy(settings.get("insecure_listen")):
        return
    for key, default in LISTENERS[binary].items():
        addr = settings.get(key, default)
        if not is_loopback(addr):
            bad(where, f"{key} {addr} is beyond loopback without api_token_file or insecure_listen: "
                       f"sluice-{binary} refuses to start")


def env_settings(binary: str, env: dict) -> dict:
    """SLUICE_* environment → TOML-style keys of `binary`."""
    prefix = "SLUICE_AGENT_" if binary == "agent" else "SLUICE_"
    return {k[len(prefix):].lower(): v for k, v in env.items()
            if k.startswith(prefix) and (binary == "agent" or not k.startswith("SLUICE_AGENT_"))}


SLUICE_NAME = re.compile(r"\bsluice_[a-z0-9_]+")


def check_metric_names(where: str, expr: str, exported: set[str]) -> int:
    used = 0
    for name in SLUICE_NAME.findall(expr):
        used += 1
        if name not in exported:
            bad(where, f"metric {name} is not exported by the code")
    return used


# ---------------------------------------------------------------- grafana, rules


def cmd_grafana(path: str) -> None:
    exported = exported_metrics()
    try:
        dash = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        bad(path, f"JSON does not parse: {e}")
        return
    for key in ("title", "uid", "panels", "schemaVersion"):
        if key not in dash:
            bad(path, f"no {key!r}")
    ids, used = set(), 0
    for p in dash.get("panels", []):
        pid = p.get("id")
        if pid in ids:
            bad(path, f"panel id {pid} twice")
        ids.add(pid)
        if p.get("type") == "row":
            continue
        if not p.get("targets"):
            bad(path, f"panel {p.get('title')!r} has no targets")
        for t in p.get("targets", []):
            expr = t.get("expr", "")
            if not expr:
                bad(path, f"panel {p.get('title')!r} target {t.get('refId')} has no expr")
            used += check_metric_names(f"{path}: panel {p.get('title')!r}", expr, exported)
    if used == 0:
        bad(path, "no sluice_* metric used at all")


def cmd_rules(path: str) -> None:
    exported = exported_metrics()
    doc = yaml.safe_load(Path(path).read_text())
    used = 0
    for g in doc.get("groups", []):
        for r in g.get("rules", []):
            used += check_metric_names(f"{path}: {r.get('alert') or r.get('record')}", r["expr"], exported)
    if used == 0:
        bad(path, "no sluice_* metric used at all")


# ---------------------------------------------------------------- kubernetes

# Container name → (liveness path, readiness path) for the images of this project.
PROBES = {"manager": ("/healthz", "/readyz"), "sluice-agent": ("/healthz", "/readyz"),
          "agent": ("/healthz", "/readyz")}


def pod_spec(doc: dict) -> dict | None:
    if doc.get("kind") in ("Deployment", "DaemonSet", "StatefulSet"):
        return doc["spec"]["template"]["spec"]
    return None


def check_pod(where: str, spec: dict, configmaps: dict[str, dict]) -> None:
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for c in spec.get("containers", []):
        cw = f"{where}: container {c['name']}"
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        for mount in c.get("volumeMounts", []):
            if mount["name"] not in volumes:
                bad(cw, f"volumeMount {mount['name']!r} names no volume of the pod")
        for e in c.get("env", []):
            check_env_name(cw, e["name"])
        for ef in c.get("envFrom", []):
            ref = ef.get("configMapRef", {}).get("name")
            if ref is not None and ref not in configmaps:
                bad(cw, f"envFrom names ConfigMap {ref!r}, not in these manifests")
            for key in configmaps.get(ref, {}).get("data", {}):
                check_env_name(f"{cw} (envFrom {ref})", key)
        expected = PROBES.get(c["name"])
        for i, kind in enumerate(("livenessProbe", "readinessProbe")):
            probe = c.get(kind)
            if expected and probe is None:
                bad(cw, f"no {kind}")
                continue
            if probe is None:
                continue
            get = probe.get("httpGet")
            if get is None:
                continue
            if expected and get.get("path") != expected[i]:
                bad(cw, f"{kind}.httpGet.path is {get.get('path')!r}, the binary serves {expected[i]}")
            port = get.get("port")
            if isinstance(port, str) and port not in ports:
                bad(cw, f"{kind}.httpGet.port {port!r} is not a named port of the container")
        if expected and not c.get("resources", {}).get("requests"):
            bad(cw, "no resources.requests")


def label_selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels only; {} selects everything) against labels."""
    if selector.get("matchExpressions"):
        return True  # not evaluated here: assume it selects
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def check_network_policies(docs: list, pods: list) -> None:
    """`pods`: (where, labels, named ports, namespace) of every pod template."""
    policies = [(p, d) for p, d in docs if d.get("kind") == "NetworkPolicy"]
    for path, doc in policies:
        meta, spec = doc.get("metadata", {}), doc.get("spec", {})
        where = f"{path}: NetworkPolicy/{meta.get('name')}"
        selected = [p for p in pods if p[3] == meta.get("namespace")
                    and label_selects(spec.get("podSelector", {}), p[1])]
        if not selected:
            bad(where, f"podSelector {spec.get('podSelector')} selects no pod template of these manifests")
        for i, rule in enumerate(spec.get("ingress", []) or []):
            if not rule.get("from"):
                bad(where, f"ingress[{i}] has no `from`: it admits every source")
            for peer in rule.get("from", []) or []:
                if peer.get("ipBlock", {}).get("cidr") in ("0.0.0.0/0", "::/0"):
                    bad(where, f"ingress[{i}] admits {peer['ipBlock']['cidr']}")
            if not rule.get("ports"):
                bad(where, f"ingress[{i}] has no `ports`: it admits every port")
            for port in rule.get("ports", []) or []:
                name = port.get("port")
                if isinstance(name, str) and selected and not all(name in p[2] for p in selected):
                    bad(where, f"ingress[{i}] port {name!r} is not a named port of every selected pod")
    for pwhere, labels, _, ns in pods:
        covering = [d for _, d in policies
                    if d["metadata"].get("namespace") == ns
                    and "Ingress" in (d["spec"].get("policyTypes") or ["Ingress"])
                    and label_selects(d["spec"].get("podSelector", {}), labels)]
        if not covering:
            bad(pwhere, "no NetworkPolicy of type Ingress selects these pods: every pod may connect")


def cmd_k8s(paths: list[str]) -> None:
    docs = []
    for path in paths:
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if doc:
                docs.append((path, doc))
    configmaps = {d["metadata"]["name"]: d for _, d in docs if d.get("kind") == "ConfigMap"}
    pods = []  # (labels, named ports, namespace)
    policy_pods = []  # (where, labels, named ports, namespace)
    for path, doc in docs:
        where = f"{path}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        spec = pod_spec(doc)
        if spec is not None:
            labels = doc["spec"]["template"]["metadata"].get("labels", {})
            sel = doc["spec"]["selector"].get("matchLabels", {})
            if any(labels.get(k) != v for k, v in sel.items()):
                bad(where, f"selector {sel} does not match the template's labels {labels}")
            check_pod(where, spec, configmaps)
            names = {p.get("name") for c in spec["containers"] for p in c.get("ports", [])}
            pods.append((labels, names, doc["metadata"].get("namespace")))
            policy_pods.append((where, labels, names, doc["metadata"].get("namespace")))
            check_pod_listeners(where, spec, configmaps)
        if doc.get("kind") == "ConfigMap":
            for key, text in doc.get("data", {}).items():
                if key.endswith(".toml"):
                    binary = "agent" if "agent" in key else "manager"
                    check_toml(f"{where} key {key}", text, binary)
    for path, doc in docs:
        kind, meta = doc.get("kind"), doc.get("metadata", {})
        where = f"{path}: {kind}/{meta.get('name')}"
        if kind in ("Service", "PodDisruptionBudget"):
            sel = doc["spec"]["selector"]
            sel = sel.get("matchLabels", sel) if kind == "PodDisruptionBudget" else sel
            matching = [p for p in pods if p[2] == meta.get("namespace")
                        and all(p[0].get(k) == v for k, v in sel.items())]
            if not matching:
                bad(where, f"selector {sel} selects no pod template of these manifests")
            if kind == "Service":
                for port in doc["spec"].get("ports", []):
                    tp = port.get("targetPort")
                    if isinstance(tp, str) and not any(tp in p[1] for p in matching):
                        bad(where, f"targetPort {tp!r} is not a named port of the selected pods")


    check_network_policies(docs, policy_pods)


def check_pod_listeners(where: str, spec: dict, configmaps: dict[str, dict]) -> None:
    """Each sluice container's settings as it sees them: its TOML (--config, from a ConfigMap),
    then the environment (envFrom ConfigMaps, env) on top."""
    for c in spec.get("containers", []):
        image = str(c.get("image", ""))
        binary = "agent" if "sluice-agent" in image else "manager" if "sluice-manager" in image else None
        if binary is None:
            continue
        settings: dict = {}
        args = c.get("args", [])
        if "--config" in args:
            cfg = args[args.index("--config") + 1]
            for vol in spec.get("volumes", []):
                cm = configmaps.get(vol.get("configMap", {}).get("name"), {})
                text = cm.get("data", {}).get(Path(cfg).name)
                if text is not None:
                    try:
                        settings.update(tomllib.loads(text))
                    except tomllib.TOMLDecodeError:
                        pass  # reported by check_toml
        env: dict = {}
        for ef in c.get("envFrom", []):
            env.update(configmaps.get(ef.get("configMapRef", {}).get("name"), {}).get("data", {}))
        env.update({e["name"]: e.get("value", "(from a reference)") for e in c.get("env", [])})
        settings.update(env_settings(binary, env))
        check_listeners(f"{where}: container {c['name']}", binary, settings)


# ---------------------------------------------------------------- compose


def cmd_compose(path: str) -> None:
    doc = yaml.safe_load(Path(path).read_text())
    services = doc.get("services", {})
    volumes = set((doc.get("volumes") or {}).keys())
    published = {}
    if len([s for s in services if s.startswith("etcd")]) != 3:
        bad(path, "want 3 etcd members")
    if len([s for s in services if s.startswith("manager")]) != 3:
        bad(path, "want 3 managers")
    for name, svc in services.items():
        where = f"{path}: service {name}"
        if "image" not in svc and "build" not in svc:
            bad(where, "neither image nor build")
        deps = svc.get("depends_on", {})
        for dep in deps if isinstance(deps, list) else deps.keys():
            if dep not in services:
                bad(where, f"depends_on {dep!r}: no such service")
        for v in svc.get("volumes", []):
            src = v.split(":", 1)[0] if isinstance(v, str) else v.get("source")
            if src and not src.startswith((".", "/")) and src not in volumes:
                bad(where, f"volume {src!r} is not declared under volumes:")
        for p in svc.get("ports", []):
            host = str(p).rsplit(":", 1)[0]
            if host in published:
                bad(where, f"host port {host} also published by {published[host]}")
            published[host] = name
        env = svc.get("environment", {})
        for key in env if isinstance(env, dict) else [e.split("=", 1)[0] for e in env]:
            check_env_name(where, key)
        for sec in svc.get("secrets", []):
            src = sec if isinstance(sec, str) else sec.get("source")
            if src not in (doc.get("secrets") or {}):
                bad(where, f"secret {src!r} is not declared under secrets:")
        build = svc.get("build", {})
        target = build.get("target") if isinstance(build, dict) else None
        binary = target if target in ("manager", "agent") else None
        if binary and isinstance(env, dict):
            check_listeners(where, binary, env_settings(binary, env))
        if "healthcheck" in svc and "test" not in svc["healthcheck"]:
            bad(where, "healthcheck without test")
        deps_healthy = [d for d, c in (deps.items() if isinstance(deps, dict) else [])
                        if c.get("condition") == "service_healthy"]
        for d in deps_healthy:
            # The sluice images carry a HEALTHCHECK (deploy/Dockerfile); others need one here.
            target = services.get(d, {})
            if "healthcheck" not in target and "build" not in target and "sluice" not in str(target.get("image")):
                bad(where, f"waits for {d} to be healthy, but {d} has no healthcheck")


# ---------------------------------------------------------------- systemd env, toml

ENV_LINE = re.compile(r"^#?\s*([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def cmd_env(paths: list[str]) -> None:
    for path in paths:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            where = f"{path}:{n}"
            stripped = line.strip()
            if not stripped:
                continue
            m = ENV_LINE.match(stripped)
            if stripped.startswith("#") and not m:
                continue  # prose comment
            if not m:
                bad(where, f"not NAME=value: {line!r}")
                continue
            check_env_name(where, m.group(1))
            if not stripped.startswith("#") and re.search(r"(TOKEN|PASSWORD)$", m.group(1)):
                bad(where, f"{m.group(1)}: a secret in an environment file")


def cmd_toml(paths: list[str]) -> None:
    for path in paths:
        binary = "agent" if "agent" in Path(path).name else "manager"
        text = Path(path).read_text()
        check_toml(path, text, binary)
        try:
            check_listeners(path, binary, tomllib.loads(text))
        except tomllib.TOMLDecodeError:
            pass  # reported by check_toml
        # Commented-out examples (`# key = value`) must name real settings too.
        for n, line in enumerate(text.splitlines(), 1):
            m = re.match(r"^#\s*([a-z_]+)\s*=\s*\S", line)
            if m and m.group(1) not in toml_keys(binary):
                bad(f"{path}:{n}", f"commented key {m.group(1)!r} is not a setting of sluice-{binary}")


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "metrics":
        print("\n".join(sorted(exported_metrics())))
    elif cmd == "grafana":
        cmd_grafana(args[0])
    elif cmd == "rules":
        cmd_rules(args[0])
    elif cmd == "k8s":
        cmd_k8s(args)
    elif cmd == "compose":
        cmd_compose(args[0])
    elif cmd == "env":
        cmd_env(args)
    elif cmd == "toml":
        cmd_toml(args)
    else:
        print(f"unknown command {cmd!r}", file=sys.stderr)
        return 2
    for p in problems:
        print(f"  {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
