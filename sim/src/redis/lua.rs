//! The scripts' interpreter: Lua 5.1 (the version Redis embeds) with Redis's scripting API —
//! `redis.call`, `redis.pcall`, `redis.error_reply`, `redis.status_reply`, `KEYS`, `ARGV`,
//! `cjson` — and Redis 7.0's conversions between Lua values and replies.
//!
//! Not provided (no Sluice script uses them; a script that does fails loudly): `struct`,
//! `cmsgpack`, `bit`, `redis.sha1hex`, `redis.setresp`, Redis's guard against new globals.

use std::collections::HashMap;
use std::fmt;

use mlua::{Function, LightUserData, Lua, LuaOptions, MultiValue, StdLib, Table, Value};

use super::reply::{Reply, fmt_g14, fmt_g17};
use super::store::Keyspace;

/// What a script's `redis.call` reaches while the script runs.
struct Ctx {
    ks: Keyspace,
    now_us: i64,
    calls: u64,
}

/// An error reply of a command called from a script: raised through Lua, answered with its code.
#[derive(Debug)]
struct CallError(String);

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CallError {}

/// The Lua state and the scripts loaded into it (by SHA1, as `SCRIPT LOAD` names them).
pub struct Engine {
    lua: Lua,
    scripts: HashMap<String, Function>,
    texts: HashMap<String, String>,
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("scripts", &self.scripts.len())
            .finish()
    }
}

/// The SHA1 Redis names a script by (the `redis` crate's own hash, so both agree).
pub fn sha1_hex(text: &str) -> String {
    redis::Script::new(text).get_hash().to_string()
}

impl Engine {
    /// A fresh interpreter with no script loaded.
    pub fn new() -> Self {
        let lua = Lua::new_with(
            StdLib::TABLE | StdLib::STRING | StdLib::MATH,
            LuaOptions::default(),
        )
        .expect("sim: Lua state");
        install_api(&lua).expect("sim: the redis and cjson tables");
        Self {
            lua,
            scripts: HashMap::new(),
            texts: HashMap::new(),
        }
    }

    /// `SCRIPT LOAD`: compiles `text`; its SHA1, or the compile error as Redis words it.
    pub fn load(&mut self, text: &str) -> Result<String, Reply> {
        let sha = sha1_hex(text);
        if self.scripts.contains_key(&sha) {
            return Ok(sha);
        }
        let f = self
            .lua
            .load(text)
            .set_name("=user_script")
            .into_function()
            .map_err(|e| {
                Reply::err(format!(
                    "ERR Error compiling script (new function): {}",
                    first_line(&e.to_string())
                ))
            })?;
        self.scripts.insert(sha.clone(), f);
        self.texts.insert(sha.clone(), text.to_string());
        Ok(sha)
    }

    /// Whether `sha` is loaded.
    pub fn has(&self, sha: &str) -> bool {
        self.scripts.contains_key(&sha.to_ascii_lowercase())
    }

    /// The texts of the loaded scripts (what a replica holds, or a snapshot carries).
    pub fn texts(&self) -> Vec<String> {
        let mut v: Vec<_> = self.texts.values().cloned().collect();
        v.sort();
        v
    }

    /// `SCRIPT FLUSH`.
    pub fn flush(&mut self) {
        self.scripts.clear();
        self.texts.clear();
    }

    /// Runs a loaded script over `ks` at `now_us`; the script's reply and the number of
    /// commands it called.
    pub fn run(
        &mut self,
        sha: &str,
        ks: &mut Keyspace,
        now_us: i64,
        keys: &[Vec<u8>],
        argv: &[Vec<u8>],
    ) -> (Reply, u64) {
        let sha = sha.to_ascii_lowercase();
        let Some(f) = self.scripts.get(&sha).cloned() else {
            return (Reply::err("NOSCRIPT No matching script."), 0);
        };
        self.lua.set_app_data(Ctx {
            ks: std::mem::take(ks),
            now_us,
            calls: 0,
        });
        let result = (|| {
            let g = self.lua.globals();
            g.set("KEYS", strings(&self.lua, keys)?)?;
            g.set("ARGV", strings(&self.lua, argv)?)?;
            f.call::<Value>(())
        })();
        let ctx = self
            .lua
            .remove_app_data::<Ctx>()
            .expect("sim: the script's context");
        *ks = ctx.ks;
        let reply = match result {
            Ok(v) => to_reply(&v),
            Err(e) => script_error(&e, &sha),
        };
        (reply, ctx.calls)
    }
}

impl Default for Engine {
    fn default() -> Self {
        Self::new()
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

fn strings(lua: &Lua, items: &[Vec<u8>]) -> mlua::Result<Table> {
    let t = lua.create_table_with_capacity(items.len(), 0)?;
    for (i, s) in items.iter().enumerate() {
        t.raw_set(i + 1, lua.create_string(s)?)?;
    }
    Ok(t)
}

/// The error reply of a script that raised: a called command's own error keeps its code;
/// a Lua error is `ERR`.
fn script_error(e: &mlua::Error, sha: &str) -> Reply {
    if let Some(CallError(msg)) = find_call_error(e) {
        return Reply::err(format!("{msg} script: {sha}, on @user_script."));
    }
    fn text(e: &mlua::Error) -> String {
        match e {
            mlua::Error::RuntimeError(m) => m.clone(),
            mlua::Error::CallbackError { cause, .. } => text(cause),
            other => other.to_string(),
        }
    }
    let msg = text(e);
    Reply::err(format!(
        "ERR {} script: {sha}, on @user_script.",
        first_line(&msg)
    ))
}

fn find_call_error(e: &mlua::Error) -> Option<&CallError> {
    match e {
        mlua::Error::CallbackError { cause, .. } => find_call_error(cause),
        mlua::Error::WithContext { cause, .. } => find_call_error(cause),
        mlua::Error::ExternalError(inner) => inner.downcast_ref::<CallError>(),
        _ => None,
    }
}

fn install_api(lua: &Lua) -> mlua::Result<()> {
    let redis = lua.create_table()?;
    redis.set(
        "call",
        lua.create_function(|lua, args: MultiValue| match call(lua, args)? {
            Reply::Error(msg) => Err(mlua::Error::external(CallError(msg))),
            r => to_lua(lua, &r),
        })?,
    )?;
    redis.set(
        "pcall",
        lua.create_function(|lua, args: MultiValue| {
            let r = call(lua, args)?;
            to_lua(lua, &r)
        })?,
    )?;
    redis.set(
        "error_reply",
        lua.create_function(|lua, msg: mlua::String| {
            let t = lua.create_table()?;
            let msg = msg.to_str()?.to_string();
            let msg = if msg.starts_with('-') {
                msg
            } else {
                format!("-{msg}")
            };
            t.set("err", msg)?;
            Ok(t)
        })?,
    )?;
    redis.set(
        "status_reply",
        lua.create_function(|lua, msg: mlua::String| {
            let t = lua.create_table()?;
            t.set("ok", msg)?;
            Ok(t)
        })?,
    )?;
    redis.set("log", lua.create_function(|_, _: MultiValue| Ok(()))?)?;
    for (name, level) in [
        ("LOG_DEBUG", 0),
        ("LOG_VERBOSE", 1),
        ("LOG_NOTICE", 2),
        ("LOG_WARNING", 3),
    ] {
        redis.set(name, level)?;
    }
    lua.globals().set("redis", redis)?;

    let cjson = lua.create_table()?;
    cjson.set(
        "decode",
        lua.create_function(|lua, s: mlua::String| {
            let doc: serde_json::Value = serde_json::from_slice(&s.as_bytes())
                .map_err(|e| mlua::Error::RuntimeError(format!("Expected value: {e}")))?;
            json_to_lua(lua, &doc)
        })?,
    )?;
    cjson.set(
        "encode",
        lua.create_function(|_, v: Value| {
            let mut out = String::new();
            encode_json(&v, &mut out, 0)?;
            Ok(out)
        })?,
    )?;
    cjson.set(
        "null",
        Value::LightUserData(LightUserData(std::ptr::null_mut())),
    )?;
    lua.globals().set("cjson", cjson)?;
    Ok(())
}

/// `redis.call`'s arguments as Redis converts them, run against the script's keyspace.
fn call(lua: &Lua, args: MultiValue) -> mlua::Result<Reply> {
    if args.is_empty() {
        return Ok(Reply::err(
            "ERR Please specify at least one argument for this redis lib call",
        ));
    }
    let mut argv = Vec::with_capacity(args.len());
    for a in args.iter() {
        match a {
            Value::String(s) => argv.push(s.as_bytes().to_vec()),
            Value::Number(n) => argv.push(fmt_g17(*n).into_bytes()),
            Value::Integer(i) => argv.push(i.to_string().into_bytes()),
            _ => {
                return Ok(Reply::err(
                    "ERR Lua redis lib command arguments must be strings or integers",
                ));
            }
        }
    }
    let mut ctx = lua
        .app_data_mut::<Ctx>()
        .ok_or_else(|| mlua::Error::RuntimeError("redis.call outside a script".into()))?;
    ctx.calls += 1;
    let name = String::from_utf8_lossy(&argv[0]).to_ascii_uppercase();
    if name == "TIME" {
        return Ok(time_reply(ctx.now_us));
    }
    let now_ms = ctx.now_us.div_euclid(1000);
    Ok(ctx
        .ks
        .exec(&argv, now_ms)
        .unwrap_or_else(|| Reply::err("ERR Unknown Redis command called from script")))
}

/// `TIME`: seconds and microseconds, as two bulk strings.
pub fn time_reply(now_us: i64) -> Reply {
    Reply::Array(vec![
        Reply::text(now_us.div_euclid(1_000_000).to_string()),
        Reply::text(now_us.rem_euclid(1_000_000).to_string()),
    ])
}

/// A reply as `redis.call` hands it to Lua (RESP2 rules).
fn to_lua(lua: &Lua, r: &Reply) -> mlua::Result<Value> {
    Ok(match r {
        Reply::Nil | Reply::NilArray => Value::Boolean(false),
        Reply::Int(n) => Value::Number(*n as f64),
        Reply::Bulk(b) => Value::String(lua.create_string(b)?),
        Reply::Status(s) => {
            let t = lua.create_table()?;
            t.set("ok", s.as_str())?;
            Value::Table(t)
        }
        Reply::Error(s) => {
            let t = lua.create_table()?;
            t.set("err", s.as_str())?;
            Value::Table(t)
        }
        Reply::Array(items) => {
            let t = lua.create_table_with_capacity(items.len(), 0)?;
            for (i, item) in items.iter().enumerate() {
                t.raw_set(i + 1, to_lua(lua, item)?)?;
            }
            Value::Table(t)
        }
    })
}

/// A script's return value as Redis 7.0 answers it (RESP2).
fn to_reply(v: &Value) -> Reply {
    match v {
        Value::Nil => Reply::Nil,
        Value::Boolean(true) => Reply::Int(1),
        Value::Boolean(false) => Reply::Nil,
        Value::Number(n) => Reply::Int(c_cast(*n)),
        Value::Integer(i) => Reply::Int(*i),
        Value::String(s) => Reply::Bulk(s.as_bytes().to_vec()),
        Value::Table(t) => {
            if let Ok(Value::String(e)) = t.raw_get::<Value>("err") {
                let msg = e.to_string_lossy();
                return Reply::Error(msg.strip_prefix('-').unwrap_or(&msg).to_string());
            }
            if let Ok(Value::String(s)) = t.raw_get::<Value>("ok") {
                return Reply::Status(s.to_string_lossy());
            }
            let mut items = Vec::new();
            for i in 1.. {
                match t.raw_get::<Value>(i) {
                    Ok(Value::Nil) | Err(_) => break,
                    Ok(item) => items.push(to_reply(&item)),
                }
            }
            Reply::Array(items)
        }
        _ => Reply::Nil,
    }
}

/// C's `(long long)` of a double on x86-64, as Redis converts a script's number: toward zero,
/// and the "integer indefinite" `i64::MIN` for NaN and anything out of range (Rust's `as`
/// saturates instead; the differential test found the difference: `math.huge` comes back as
/// `i64::MIN` from a real Redis).
fn c_cast(n: f64) -> i64 {
    if n.is_nan() || !(-9_223_372_036_854_775_808.0..9_223_372_036_854_775_808.0).contains(&n) {
        i64::MIN
    } else {
        n as i64
    }
}

fn json_to_lua(lua: &Lua, doc: &serde_json::Value) -> mlua::Result<Value> {
    use serde_json::Value as J;
    Ok(match doc {
        J::Null => Value::LightUserData(LightUserData(std::ptr::null_mut())),
        J::Bool(b) => Value::Boolean(*b),
        J::Number(n) => Value::Number(n.as_f64().unwrap_or(0.0)),
        J::String(s) => Value::String(lua.create_string(s)?),
        J::Array(items) => {
            let t = lua.create_table_with_capacity(items.len(), 0)?;
            for (i, item) in items.iter().enumerate() {
                t.raw_set(i + 1, json_to_lua(lua, item)?)?;
            }
            Value::Table(t)
        }
        J::Object(fields) => {
            let t = lua.create_table()?;
            for (k, v) in fields {
                t.raw_set(k.as_str(), json_to_lua(lua, v)?)?;
            }
            Value::Table(t)
        }
    })
}

/// lua-cjson's encoder: tables of positive integer keys are arrays (unless excessively sparse),
/// other tables objects, in the table's own iteration order; numbers as `%.14g`; `/` escaped.
fn encode_json(v: &Value, out: &mut String, depth: usize) -> mlua::Result<()> {
    if depth > 1000 {
        return Err(mlua::Error::RuntimeError(
            "Cannot serialise, excessive nesting (1001)".into(),
        ));
    }
    match v {
        Value::Nil => out.push_str("null"),
        Value::LightUserData(p) if p.0.is_null() => out.push_str("null"),
        Value::Boolean(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if !n.is_finite() {
                return Err(mlua::Error::RuntimeError(
                    "Cannot serialise number: must not be NaN or Infinity".into(),
                ));
            }
            out.push_str(&fmt_g14(*n));
        }
        Value::Integer(i) => out.push_str(&i.to_string()),
        Value::String(s) => escape_json(&s.as_bytes(), out),
        Value::Table(t) => {
            let mut max = 0usize;
            let mut count = 0usize;
            let mut array = true;
            for pair in t.clone().pairs::<Value, Value>() {
                let (k, _) = pair?;
                count += 1;
                match k {
                    Value::Number(n) if n >= 1.0 && n.fract() == 0.0 => max = max.max(n as usize),
                    Value::Integer(i) if i >= 1 => max = max.max(i as usize),
                    _ => array = false,
                }
            }
            if array && max > 0 {
                if max > count * 2 && max > 10 {
                    return Err(mlua::Error::RuntimeError(
                        "Cannot serialise table: excessively sparse array".into(),
                    ));
                }
                out.push('[');
                for i in 1..=max {
                    if i > 1 {
                        out.push(',');
                    }
                    encode_json(&t.raw_get::<Value>(i)?, out, depth + 1)?;
                }
                out.push(']');
            } else {
                out.push('{');
                let mut first = true;
                for pair in t.clone().pairs::<Value, Value>() {
                    let (k, val) = pair?;
                    if !first {
                        out.push(',');
                    }
                    first = false;
                    match &k {
                        Value::String(s) => escape_json(&s.as_bytes(), out),
                        Value::Number(n) => escape_json(fmt_g14(*n).as_bytes(), out),
                        Value::Integer(i) => escape_json(i.to_string().as_bytes(), out),
                        _ => {
                            return Err(mlua::Error::RuntimeError(
                                "Cannot serialise: table key must be a number or string".into(),
                            ));
                        }
                    }
                    out.push(':');
                    encode_json(&val, out, depth + 1)?;
                }
                out.push('}');
            }
        }
        other => {
            return Err(mlua::Error::RuntimeError(format!(
                "Cannot serialise {}: type not supported",
                other.type_name()
            )));
        }
    }
    Ok(())
}

fn escape_json(s: &[u8], out: &mut String) {
    out.push('"');
    for &c in s {
        match c {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            b'/' => out.push_str("\\/"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\t' => out.push_str("\\t"),
            0x08 => out.push_str("\\b"),
            0x0c => out.push_str("\\f"),
            c if c < 0x20 || c == 0x7f => out.push_str(&format!("\\u{c:04x}")),
            // Bytes ≥ 0x80 pass through as they are (lua-cjson does not validate UTF-8).
            c => out.push(char::from(c)),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(text: &str) -> Reply {
        let mut e = Engine::new();
        let sha = e.load(text).expect("compiles");
        let mut ks = Keyspace::default();
        e.run(&sha, &mut ks, 1_700_000_000_250_000, &[], &[]).0
    }

    #[test]
    fn conversions_follow_redis_7() {
        assert_eq!(eval("return 3.9"), Reply::Int(3));
        assert_eq!(eval("return -3.9"), Reply::Int(-3));
        assert_eq!(eval("return math.huge"), Reply::Int(i64::MIN));
        assert_eq!(eval("return -math.huge"), Reply::Int(i64::MIN));
        assert_eq!(eval("return true"), Reply::Int(1));
        assert_eq!(eval("return false"), Reply::Nil);
        assert_eq!(
            eval("return {1,2,nil,4}"),
            Reply::Array(vec![Reply::Int(1), Reply::Int(2)])
        );
        assert_eq!(
            eval("return redis.error_reply('FENCE x y')"),
            Reply::err("FENCE x y")
        );
        assert_eq!(
            eval("return redis.status_reply('FOO')"),
            Reply::Status("FOO".into())
        );
        assert_eq!(
            eval("redis.call('SET','k',0.1) return redis.call('GET','k')"),
            Reply::text("0.10000000000000001")
        );
        assert_eq!(
            eval("return tostring(redis.call('HGET','nokey','f'))"),
            Reply::text("false")
        );
        assert_eq!(
            eval("return type(redis.call('SET','k','v'))"),
            Reply::text("table")
        );
        assert_eq!(
            eval("return redis.call('TIME')"),
            Reply::Array(vec![Reply::text("1700000000"), Reply::text("250000")])
        );
    }

    #[test]
    fn errors_keep_their_code() {
        match eval("redis.call('SET','k','v') return redis.call('HSET','k','a',1)") {
            Reply::Error(e) => assert!(e.starts_with("WRONGTYPE "), "{e}"),
            r => panic!("{r:?}"),
        }
        match eval("return nosuch.x") {
            Reply::Error(e) => assert!(e.starts_with("ERR user_script:1:"), "{e}"),
            r => panic!("{r:?}"),
        }
        match eval("return redis.call('NOSUCH')") {
            Reply::Error(e) => assert!(e.starts_with("ERR Unknown Redis command"), "{e}"),
            r => panic!("{r:?}"),
        }
    }

    #[test]
    fn cjson_decodes_and_encodes_as_lua_cjson_does() {
        assert_eq!(
            eval(
                r#"local d = cjson.decode('{"a":[1,2.5,null],"z":"x/y"}') return {d.a[2] * 2, d.z, tostring(d.a[3] == cjson.null)}"#
            ),
            Reply::Array(vec![Reply::Int(5), Reply::text("x/y"), Reply::text("true")])
        );
        assert_eq!(
            eval(r#"return cjson.encode({1, 2.5, "a/b"})"#),
            Reply::text(r#"[1,2.5,"a\/b"]"#)
        );
        assert_eq!(eval("return cjson.encode({})"), Reply::text("{}"));
        assert!(matches!(
            eval("return pcall(cjson.decode, 'not json')"),
            Reply::Nil
        ));
    }
}
