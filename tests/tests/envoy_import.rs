//! `POST /api/v1/import/envoy-ratelimit` against a real replica (etcd, Redis): an
//! envoyproxy/ratelimit YAML config becomes Sluice tasks (rolled into Redis like any task) and
//! a compiled domain in the `NS:envoy` hash; re-imports replace, refusals name field and line
//! and change nothing; DELETE removes the domain, its tasks and its hash field.

use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_protocol::{Keys, meta_field};
use sluice_tests::*;

const IMPORT: &str = "/api/v1/import/envoy-ratelimit";

const CONFIG: &str = "\
domain: shop
descriptors:
  # plain key/value
  - key: path
    value: checkout
    rate_limit:
      name: checkout
      unit: second
      requests_per_unit: 50
  # a wildcard: every remote address its own limit
  - key: remote_address
    rate_limit:
      unit: minute
      requests_per_unit: 600
  # nested: tenant=acme / plan=gold, in shadow mode
  - key: tenant
    value: acme
    descriptors:
      - key: plan
        value: gold
        shadow_mode: true
        rate_limit:
          unit: hour
          requests_per_unit: 7200
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

async fn post_yaml(m: &Manager, body: &str) -> (u16, Value) {
    let r = m
        .request(reqwest::Method::POST, IMPORT)
        .header("content-type", "application/yaml")
        .body(body.to_string())
        .send()
        .await
        .expect("POST");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// `(name, threshold, slice_ms, keyed, shadow, version)` of every task, sorted by name.
async fn tasks(m: &Manager) -> Vec<(String, u64, u64, bool, bool, i64)> {
    let v = m
        .get_json("/api/v1/tasks")
        .await
        .expect("GET /api/v1/tasks");
    let mut out: Vec<_> = v["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_string(),
                t["threshold"].as_u64().unwrap(),
                t["slice_ms"].as_u64().unwrap(),
                t["keyed"].as_bool().unwrap_or(false),
                t["shadow"].as_bool().unwrap_or(false),
                t["version"].as_i64().unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

fn hash_field(keys: &Keys, domain: &str) -> Option<Value> {
    let mut c = redis_conn(&shared_redis());
    let v: Option<String> = redis::cmd("HGET")
        .arg(keys.envoy_routes())
        .arg(domain)
        .query(&mut c)
        .unwrap();
    v.map(|s| serde_json::from_str(&s).expect("NS:envoy value is JSON"))
}

/// The mirror fence of `domain` (`NS:envoy:fence` field): (epoch, term, Redis time it was
/// claimed or refreshed, ms).
fn mirror_fence(keys: &Keys, domain: &str) -> Option<(String, i64, i64)> {
    let mut c = redis_conn(&shared_redis());
    let v: Option<String> = redis::cmd("HGET")
        .arg(keys.envoy_fence())
        .arg(domain)
        .query(&mut c)
        .unwrap();
    let v = v?;
    let mut it = v.split(' ');
    let (e, t, at) = (it.next()?, it.next()?, it.next()?);
    Some((e.to_string(), t.parse().ok()?, at.parse().ok()?))
}

fn meta_version(keys: &Keys, task: &str) -> Option<i64> {
    let mut c = redis_conn(&shared_redis());
    redis::cmd("HGET")
        .arg(keys.meta(task))
        .arg(meta_field::VERSION)
        .query(&mut c)
        .unwrap()
}

fn sorted(v: &Value) -> Vec<String> {
    let mut out: Vec<String> = v
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_reimport_refuse_and_delete() {
    let ns = unique_ns("envoy");
    let keys = Keys::new(&ns).unwrap();
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &shared_redis(), &ns, "n0")).await;
    m.wait_leader().await;

    // --- import
    let (s, a) = post_yaml(&m, CONFIG).await;
    assert_eq!(s, 200, "{a}");
    assert_eq!(a["domain"], "shop");
    assert_eq!(
        sorted(&a["created"]),
        [
            "shop.path_checkout",
            "shop.remote_address",
            "shop.tenant_acme.plan_gold",
            "shop.tenant_acme.user"
        ]
    );
    assert_eq!(sorted(&a["updated"]), Vec::<String>::new());
    assert_eq!(sorted(&a["deleted"]), Vec::<String>::new());
    assert_eq!(a["tasks"].as_array().unwrap().len(), 4);
    assert_eq!(a["tasks"][2]["path"], "tenant=acme / plan=gold");

    let listed = tasks(&m).await;
    let shape: Vec<_> = listed
        .iter()
        .map(|(n, t, s, k, sh, _)| (n.as_str(), *t, *s, *k, *sh))
        .collect();
    assert_eq!(
        shape,
        vec![
            ("shop.path_checkout", 50, 1000, false, false),
            ("shop.remote_address", 600, 60_000, true, false),
            ("shop.tenant_acme.plan_gold", 7200, 3_600_000, false, true),
            ("shop.tenant_acme.user", 1000, 86_400_000, true, false),
        ]
    );
    let detail = m
        .get_json("/api/v1/tasks/shop.tenant_acme.plan_gold")
        .await
        .unwrap();
    assert_eq!(
        detail["description"],
        "envoy-ratelimit shop: tenant=acme / plan=gold (line 19)"
    );

    // The leader rolls their meta like any task's.
    for (name, .., version) in &listed {
        wait_until(
            &format!("meta of {name}"),
            Duration::from_secs(10),
            Duration::from_millis(50),
            || async { (meta_version(&keys, name) == Some(*version)).then_some(()) },
        )
        .await;
    }
    // And mirrors the compiled domain into NS:envoy.
    let routes = wait_until(
        "NS:envoy[shop]",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async { hash_field(&keys, "shop") },
    )
    .await;
    assert_eq!(routes["domain"], "shop");
    let v1 = routes["version"].as_u64().unwrap();
    assert_eq!(v1 as i64, a["version"].as_i64().unwrap());
    let d = &routes["descriptors"];
    assert_eq!(d.as_array().unwrap().len(), 4);
    assert_eq!(d[0]["task"], "shop.path_checkout");
    assert_eq!(d[0]["name"], "checkout");
    assert_eq!(d[1]["keyed"], true);
    assert_eq!(d[1]["value"], Value::Null);
    assert_eq!(d[2]["task"], Value::Null);
    assert_eq!(d[2]["descriptors"][0]["shadow"], true);
    assert_eq!(d[2]["descriptors"][1]["replaces"][0], "checkout");
    assert_eq!(d[2]["descriptors"][1]["unit"], "day");
    assert_eq!(d[3]["unlimited"], true);
    assert_eq!(d[3]["task"], Value::Null);

    // The mirror reconciles: a field of no domain is deleted, a field rolled back to an
    // older version (or garbage) is rewritten from etcd.
    {
        let mut c = redis_conn(&shared_redis());
        let () = redis::cmd("HSET")
            .arg(keys.envoy_routes())
            .arg("ghost")
            .arg(r#"{"domain":"ghost","version":1,"descriptors":[]}"#)
            .arg("shop")
            .arg(r#"{"domain":"shop","version":1,"descriptors":[]}"#)
            .query::<i64>(&mut c)
            .map(|_| ())
            .unwrap();
    }
    wait_until(
        "NS:envoy reconciled",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async {
            (hash_field(&keys, "ghost").is_none()
                && hash_field(&keys, "shop").is_some_and(|v| v == routes))
            .then_some(())
        },
    )
    .await;

    let domains = m.get_json(IMPORT).await.unwrap();
    assert_eq!(domains["domains"][0]["domain"], "shop");
    assert_eq!(domains["domains"][0]["tasks"].as_array().unwrap().len(), 4);

    // --- re-import: remote_address removed, plan=gold changed, the rest as before
    let second = CONFIG
        .replace(
            "  - key: remote_address\n    rate_limit:\n      unit: minute\n      requests_per_unit: 600\n",
            // Four lines for four: the other descriptors keep their lines, so the tasks of
            // those unchanged keep their descriptions ("… (line N)") too.
            "  # removed\n  #\n  #\n  #\n",
        )
        .replace("requests_per_unit: 7200", "requests_per_unit: 3600");
    let (s, b) = post_yaml(&m, &second).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(sorted(&b["created"]), Vec::<String>::new());
    assert_eq!(sorted(&b["deleted"]), ["shop.remote_address"]);
    assert_eq!(sorted(&b["updated"]), ["shop.tenant_acme.plan_gold"]);
    assert_eq!(
        sorted(&b["unchanged"]),
        ["shop.path_checkout", "shop.tenant_acme.user"]
    );
    let listed = tasks(&m).await;
    assert!(
        !listed.iter().any(|t| t.0 == "shop.remote_address"),
        "{listed:?}"
    );
    assert!(
        listed
            .iter()
            .any(|t| t.0 == "shop.tenant_acme.plan_gold" && t.1 == 3600),
        "{listed:?}"
    );
    let v2 = wait_until(
        "NS:envoy[shop] of the re-import",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async {
            hash_field(&keys, "shop")
                .and_then(|v| v["version"].as_u64())
                .filter(|v| *v > v1)
        },
    )
    .await;
    assert_eq!(v2 as i64, b["version"].as_i64().unwrap());
    // The removed task's meta is retired by the leader (it no longer has a version).
    wait_until(
        "meta of the removed task retired",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async {
            meta_version(&keys, "shop.remote_address")
                .is_none()
                .then_some(())
        },
    )
    .await;

    // --- refusals: each names field and line, and nothing changes
    let (s, user) = m
        .put(
            "/api/v1/tasks/shop.remote_address",
            r#"{"threshold": 5, "description": "a user's task"}"#,
        )
        .await;
    assert_eq!(s, 201, "{user}");
    let before = tasks(&m).await;
    let doc_before = m.get_json(IMPORT).await.unwrap();
    let cases: Vec<(String, u16, &str, u64)> = vec![
        (
            CONFIG.replace("unit: hour", "unit: week"),
            400,
            "descriptors[2].descriptors[0].rate_limit.unit",
            23,
        ),
        // Value wildcards are patterns now (issue 23 item 15 h); share_threshold needs one.
        (
            CONFIG.replace(
                "value: checkout",
                "value: checkout\n    share_threshold: true",
            ),
            400,
            "descriptors[0].share_threshold",
            6,
        ),
        (
            CONFIG.replace("shadow_mode: true", "shadow: true"),
            400,
            "descriptors[2].descriptors[0].shadow",
            21,
        ),
        // The user's task has the name the wildcard descriptor would make.
        (CONFIG.to_string(), 409, "descriptors[1]", 11),
    ];
    for (body, status, field, line) in &cases {
        let (s, e) = post_yaml(&m, body).await;
        assert_eq!(s, *status, "{e}");
        assert_eq!(e["field"], *field, "{e}");
        assert_eq!(e["line"], *line, "{e}");
        assert!(e["error"].as_str().is_some_and(|t| !t.is_empty()), "{e}");
        assert_eq!(
            tasks(&m).await,
            before,
            "a refused import changed tasks: {e}"
        );
        assert_eq!(m.get_json(IMPORT).await.unwrap(), doc_before);
    }
    let (_, e) = post_yaml(&m, CONFIG).await;
    assert_eq!(e["task"], "shop.remote_address");
    assert!(
        e["error"].as_str().unwrap().contains("shop.remote_address"),
        "{e}"
    );
    // Other content types are refused before anything is read.
    let r = m
        .request(reqwest::Method::POST, IMPORT)
        .header("content-type", "text/plain")
        .body(CONFIG)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 415);

    // --- delete: the domain, its tasks and its NS:envoy field go; the user's task stays
    let r = m
        .request(reqwest::Method::DELETE, &format!("{IMPORT}/shop"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        sorted(&body["deleted"]),
        [
            "shop.path_checkout",
            "shop.tenant_acme.plan_gold",
            "shop.tenant_acme.user"
        ]
    );
    let left: Vec<String> = tasks(&m).await.into_iter().map(|t| t.0).collect();
    assert_eq!(left, ["shop.remote_address"]);
    assert_eq!(
        m.get_json(IMPORT).await.unwrap()["domains"],
        serde_json::json!([])
    );
    wait_until(
        "NS:envoy[shop] removed",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async { hash_field(&keys, "shop").is_none().then_some(()) },
    )
    .await;
    assert_eq!(m.delete(&format!("{IMPORT}/shop")).await, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_needs_the_admin_token() {
    let ns = unique_ns("envoy-auth");
    let mut o = ManagerOpts::new(&shared_etcd(), &shared_redis(), &ns, "n0");
    o.extra = vec!["--api-token".into(), "s3cret-admin".into()];
    let m = Manager::start(o).await;
    let (s, _) = post_yaml(&m, CONFIG).await;
    assert_eq!(s, 401);
    let r = m
        .request(reqwest::Method::POST, IMPORT)
        .bearer_auth("s3cret-admin")
        .header("content-type", "application/yaml")
        .body(CONFIG)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
}

/// The documented ACL users (`deploy/redis-acl.conf`, namespace substituted), created on the
/// test Redis with `ACL SETUSER`: workers may read `NS:envoy` (HGETALL, HGET) and not write
/// it; the manager may write, read and delete it.
#[test]
fn documented_acl_lets_workers_read_and_the_manager_write_ns_envoy() {
    let ns = unique_ns("envoyacl");
    let keys = Keys::new(&ns).unwrap();
    let doc = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/redis-acl.conf");
    let text = std::fs::read_to_string(&doc).expect("deploy/redis-acl.conf");
    let mut admin = redis_conn(&shared_redis());
    let mut users = Vec::new();
    for line in text.lines().filter(|l| l.starts_with("user sluice-")) {
        let line = line.replace("sluice:", &format!("{ns}:"));
        let mut words = line.split_whitespace().skip(1);
        let role = words.next().unwrap().to_string();
        let user = format!("{role}-{ns}");
        let mut cmd = redis::cmd("ACL");
        cmd.arg("SETUSER").arg(&user);
        for w in words {
            cmd.arg(if w == ">CHANGE-ME" {
                ">pw-envoy-acl"
            } else {
                w
            });
        }
        let () = cmd.query(&mut admin).expect("ACL SETUSER");
        users.push((role, user));
    }
    let connect = |role: &str| {
        let user = &users.iter().find(|(r, _)| r == role).unwrap().1;
        let url = shared_redis().replacen("redis://", &format!("redis://{user}:pw-envoy-acl@"), 1);
        redis_conn(&url)
    };
    let hash = keys.envoy_routes();
    let mut mgr = connect("sluice-manager");
    let mut wrk = connect("sluice-worker");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let () = redis::cmd("HSET")
            .arg(&hash)
            .arg("d")
            .arg("{}")
            .query::<i64>(&mut mgr)
            .map(|_| ())
            .expect("manager HSET");
        let all: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
            .arg(&hash)
            .query(&mut wrk)
            .expect("worker HGETALL");
        assert_eq!(all.get("d").map(String::as_str), Some("{}"));
        let one: Option<String> = redis::cmd("HGET")
            .arg(&hash)
            .arg("d")
            .query(&mut wrk)
            .unwrap();
        assert_eq!(one.as_deref(), Some("{}"));
        let denied = redis::cmd("HSET")
            .arg(&hash)
            .arg("d")
            .arg("x")
            .query::<i64>(&mut wrk)
            .expect_err("a worker must not write NS:envoy");
        assert!(
            denied.to_string().to_lowercase().contains("noperm"),
            "{denied}"
        );
        let _: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
            .arg(&hash)
            .query(&mut mgr)
            .expect("manager HGETALL");
        let _: i64 = redis::cmd("HDEL")
            .arg(&hash)
            .arg("d")
            .query(&mut mgr)
            .expect("manager HDEL");
        let _: i64 = redis::cmd("DEL")
            .arg(&hash)
            .query(&mut mgr)
            .expect("manager DEL");
        // The mirror's fence hash (same Cluster slot as NS:envoy, under the manager's pattern).
        let _: i64 = redis::cmd("HSET")
            .arg(keys.envoy_fence())
            .arg("d")
            .arg("1 1 1")
            .query(&mut mgr)
            .expect("manager HSET fence");
        let _: i64 = redis::cmd("DEL")
            .arg(keys.envoy_fence())
            .query(&mut mgr)
            .expect("manager DEL fence");
    }));
    for (_, user) in &users {
        let _: redis::RedisResult<i64> =
            redis::cmd("ACL").arg("DELUSER").arg(user).query(&mut admin);
    }
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}

/// A one-limit domain config: `domain` with `path=checkout` at `rpu` per minute.
fn one_limit(domain: &str, rpu: u64) -> String {
    format!(
        "domain: {domain}\ndescriptors:\n  - key: path\n    value: checkout\n    rate_limit:\n      unit: minute\n      requests_per_unit: {rpu}\n"
    )
}

/// The `requests_per_unit` of the first descriptor of `domain` in `NS:envoy`.
fn mirrored_rpu(keys: &Keys, domain: &str) -> Option<u64> {
    hash_field(keys, domain).and_then(|v| v["descriptors"][0]["requests_per_unit"].as_u64())
}

/// Issue 23 item 12: the mirror `NS:envoy` is fenced per domain by epoch and term, as slice
/// keys are. Two live manager clusters (two etcds) on one namespace: each keeps its own domain
/// (before, each leader deleted the other's domain every tick: RLS then answered without a
/// limit), a domain both import stays the first cluster's for as long as that cluster runs
/// (its fence is refreshed, never stale), and is taken over by the second cluster only
/// `--fence-stale-after` after the first stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_manager_clusters_keep_each_others_domains() {
    const STALE: Duration = Duration::from_secs(3);
    let ns = unique_ns("envoy2cl");
    let keys = Keys::new(&ns).unwrap();
    let redis = shared_redis();
    let start = |etcd: String, node: &'static str| {
        let redis = redis.clone();
        let ns = ns.clone();
        async move {
            let mut o = ManagerOpts::new(&etcd, &redis, &ns, node);
            o.env = vec![(
                "SLUICE_FENCE_STALE_AFTER".into(),
                format!("{}s", STALE.as_secs()),
            )];
            let m = Manager::start(o).await;
            m.wait_leader().await;
            m
        }
    };
    let mut a = start(shared_etcd(), "a1").await;
    let etcd_b = EtcdServer::start();
    let b = start(etcd_b.endpoint(), "b1").await;

    let (s, v) = post_yaml(&a, &one_limit("alpha", 10)).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = post_yaml(&b, &one_limit("beta", 20)).await;
    assert_eq!(s, 200, "{v}");
    wait_until(
        "both domains mirrored",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let both =
                mirrored_rpu(&keys, "alpha") == Some(10) && mirrored_rpu(&keys, "beta") == Some(20);
            async move { both.then_some(()) }
        },
    )
    .await;
    // B imports alpha too: it must not overwrite A's while A runs.
    let (s, v) = post_yaml(&b, &one_limit("alpha", 30)).await;
    assert_eq!(s, 200, "{v}");
    // Longer than the stale period: every check sees both domains as their owners wrote them.
    let until = Instant::now() + STALE * 2 + Duration::from_secs(1);
    let mut checks = 0;
    while Instant::now() < until {
        assert_eq!(
            mirrored_rpu(&keys, "alpha"),
            Some(10),
            "check {checks}: alpha lost or overwritten"
        );
        assert_eq!(
            mirrored_rpu(&keys, "beta"),
            Some(20),
            "check {checks}: beta lost"
        );
        checks += 1;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(checks > 100, "{checks}");
    assert!(b.log_count("its fence is another leader's") >= 1);
    assert!(a.log_count("its fence is another leader's") >= 1);

    // A stops: B takes alpha over once A's fence is stale, not before. A refreshes its fence
    // when it is a quarter of STALE old, so its last refresh may be up to STALE / 4 + one
    // mirror pass before the stop: the bound is judged on the fence's own times (Redis clock),
    // A's last refresh (read once A has exited) to B's claim.
    a.proc.stop_with(libc::SIGTERM, Duration::from_secs(10));
    let stopped = Instant::now();
    let (epoch_a, _, a_at) = mirror_fence(&keys, "alpha").expect("A's fence on alpha");
    wait_until(
        "the second cluster to take alpha over",
        STALE + Duration::from_secs(8),
        Duration::from_millis(50),
        || {
            let got = mirrored_rpu(&keys, "alpha");
            async move { (got == Some(30)).then_some(()) }
        },
    )
    .await;
    let took = stopped.elapsed();
    // B's claim time: a later refresh by B only moves it later (never a false failure).
    let (epoch_b, _, b_at) = mirror_fence(&keys, "alpha").expect("B's fence on alpha");
    eprintln!(
        "alpha taken over {took:?} after the first cluster stopped, {} ms after its last \
         fence refresh",
        b_at - a_at
    );
    assert_ne!(epoch_a, epoch_b, "the fence is the second cluster's");
    assert!(
        b_at - a_at >= STALE.as_millis() as i64,
        "taken over {} ms after A's last refresh (< {STALE:?})",
        b_at - a_at
    );
    assert_eq!(mirrored_rpu(&keys, "beta"), Some(20));
    drop(etcd_b);
}
