//! What a command answers, before it reaches a client (RESP2, as the scripts and the SDK see it).

use std::fmt::Write as _;

/// One RESP2 reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// `$-1`: a missing key or field.
    Nil,
    /// `*-1`.
    NilArray,
    /// `:n`.
    Int(i64),
    /// `$n`: a binary-safe string.
    Bulk(Vec<u8>),
    /// `+s`.
    Status(String),
    /// `-CODE message`.
    Error(String),
    /// `*n`.
    Array(Vec<Reply>),
}

impl Reply {
    /// `+OK`.
    pub fn ok() -> Self {
        Self::Status("OK".into())
    }

    /// An error reply; `msg` starts with its code (`ERR`, `WRONGTYPE`, …).
    pub fn err(msg: impl Into<String>) -> Self {
        Self::Error(msg.into())
    }

    /// The reply Redis gives a key of another type.
    pub fn wrong_type() -> Self {
        Self::err("WRONGTYPE Operation against a key holding the wrong kind of value")
    }

    /// The reply Redis gives a non-integer where an integer is needed.
    pub fn not_integer() -> Self {
        Self::err("ERR value is not an integer or out of range")
    }

    /// The reply Redis gives a bad option.
    pub fn syntax() -> Self {
        Self::err("ERR syntax error")
    }

    /// A bulk string from text.
    pub fn text(s: impl AsRef<[u8]>) -> Self {
        Self::Bulk(s.as_ref().to_vec())
    }

    /// Appends the reply's RESP2 encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Self::Nil => out.extend_from_slice(b"$-1\r\n"),
            Self::NilArray => out.extend_from_slice(b"*-1\r\n"),
            Self::Int(n) => out.extend_from_slice(format!(":{n}\r\n").as_bytes()),
            Self::Bulk(b) => {
                out.extend_from_slice(format!("${}\r\n", b.len()).as_bytes());
                out.extend_from_slice(b);
                out.extend_from_slice(b"\r\n");
            }
            Self::Status(s) => out.extend_from_slice(format!("+{}\r\n", one_line(s)).as_bytes()),
            Self::Error(s) => out.extend_from_slice(format!("-{}\r\n", one_line(s)).as_bytes()),
            Self::Array(items) => {
                out.extend_from_slice(format!("*{}\r\n", items.len()).as_bytes());
                for i in items {
                    i.encode(out);
                }
            }
        }
    }

    /// The reply as the `redis` crate's client decodes it (through its own RESP parser, so the
    /// conversions — `+OK` to `Okay`, errors to `ServerError` with their kind — are the crate's).
    pub fn to_value(&self) -> redis::Value {
        // The common shapes directly (a simulation sends millions); errors through the parser.
        match self {
            Self::Nil | Self::NilArray => return redis::Value::Nil,
            Self::Int(n) => return redis::Value::Int(*n),
            Self::Bulk(b) => return redis::Value::BulkString(b.clone()),
            Self::Status(s) if s == "OK" => return redis::Value::Okay,
            Self::Status(s) => return redis::Value::SimpleString(one_line(s)),
            Self::Array(items) => {
                return redis::Value::Array(items.iter().map(Self::to_value).collect());
            }
            Self::Error(_) => {}
        }
        let mut bytes = Vec::new();
        self.encode(&mut bytes);
        match redis::parse_redis_value(&bytes) {
            Ok(v) => v,
            // The encoder above writes well-formed RESP; a parse failure is a bug of this file.
            Err(e) => panic!("sim: RESP the redis crate does not parse ({e}): {self:?}"),
        }
    }
}

/// Status and error lines cannot hold CR or LF (Redis replaces them with spaces).
fn one_line(s: &str) -> String {
    s.replace(['\r', '\n'], " ")
}

/// A double as Redis 7.0 formats one in replies and script arguments: C's `%.17g`.
pub fn fmt_g17(x: f64) -> String {
    fmt_g(x, 17)
}

/// A double as Lua 5.1's `tostring` and lua-cjson print one: C's `%.14g`.
pub fn fmt_g14(x: f64) -> String {
    fmt_g(x, 14)
}

fn fmt_g(x: f64, precision: usize) -> String {
    if x.is_nan() {
        return if x.is_sign_negative() { "-nan" } else { "nan" }.into();
    }
    if x.is_infinite() {
        return if x < 0.0 { "-inf" } else { "inf" }.into();
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0" } else { "0" }.into();
    }
    // %g: scientific when the exponent is < -4 or >= precision, trailing zeros removed.
    let sci = format!("{:.*e}", precision - 1, x);
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if exp < -4 || exp >= precision as i32 {
        let mut s = String::new();
        let m = strip_zeros(mantissa);
        let _ = write!(
            s,
            "{m}e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.unsigned_abs()
        );
        s
    } else {
        let decimals = (precision as i32 - 1 - exp).max(0) as usize;
        strip_zeros(&format!("{:.*}", decimals, x)).to_string()
    }
}

fn strip_zeros(s: &str) -> &str {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_print_as_c_does() {
        assert_eq!(fmt_g17(0.1), "0.10000000000000001");
        assert_eq!(fmt_g17(5.0), "5");
        assert_eq!(fmt_g17(1e20), "1e+20");
        assert_eq!(fmt_g17(-2.5), "-2.5");
        assert_eq!(fmt_g17(1_700_000_000_123.0), "1700000000123");
        assert_eq!(fmt_g14(1e15), "1e+15");
        assert_eq!(fmt_g14(123_456_789_012_345_678.0), "1.2345678901235e+17");
        assert_eq!(fmt_g14(0.1), "0.1");
        assert_eq!(fmt_g14(0.0001), "0.0001");
        assert_eq!(fmt_g14(0.00001), "1e-05");
        assert_eq!(fmt_g14(f64::INFINITY), "inf");
    }

    #[test]
    fn the_direct_conversion_is_the_parsers() {
        let cases = [
            Reply::Nil,
            Reply::NilArray,
            Reply::Int(-7),
            Reply::text("x\r\ny"),
            Reply::ok(),
            Reply::Status("PONG".into()),
            Reply::Array(vec![
                Reply::Int(1),
                Reply::Nil,
                Reply::Array(vec![Reply::text("a")]),
            ]),
        ];
        for r in cases {
            let mut bytes = Vec::new();
            r.encode(&mut bytes);
            assert_eq!(
                r.to_value(),
                redis::parse_redis_value(&bytes).unwrap(),
                "{r:?}"
            );
        }
    }

    #[test]
    fn replies_reach_the_client_as_the_crate_decodes_them() {
        assert_eq!(Reply::ok().to_value(), redis::Value::Okay);
        assert_eq!(Reply::Nil.to_value(), redis::Value::Nil);
        let e = Reply::err("NOSCRIPT No matching script").to_value();
        match e {
            redis::Value::ServerError(e) => assert_eq!(e.code(), "NOSCRIPT"),
            other => panic!("{other:?}"),
        }
    }
}
