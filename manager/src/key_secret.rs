//! The namespace's key-label secret (`/NS/key_secret` in etcd; see
//! [`sluice_protocol::key_label`]).
//!
//! Created once, by the first leader that finds none (a create-if-absent transaction, so two
//! racing leaders end up with the same one), then only read. The roller writes it into the meta
//! of keyed tasks that do not show their keys in clear; the SDKs store their keys' labels
//! (keyed digests) in the top-key sets and key slices. It is never shown by the API or logged.

use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};
use sluice_protocol::{KeySecret, Keys};

/// Bound on each etcd call.
const ETCD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Reads the secret, creating it first when there is none. An error (etcd unreachable, a
/// stored value that is not 64 hex digits) names what failed, never the value.
pub async fn ensure(client: &Client, keys: &Keys) -> Result<KeySecret, String> {
    let key = keys.etcd_key_secret();
    let mut c = client.clone();
    for _ in 0..2 {
        let got = tokio::time::timeout(ETCD_TIMEOUT, c.get(key.as_str(), None))
            .await
            .map_err(|_| format!("etcd get {key}: timed out"))?
            .map_err(|e| format!("etcd get {key}: {e}"))?;
        if let Some(kv) = got.kvs().first() {
            let v = std::str::from_utf8(kv.value()).unwrap_or("");
            return KeySecret::parse(v)
                .ok_or_else(|| format!("{key}: not 64 lowercase hex digits"));
        }
        let fresh = KeySecret::generate().ok_or("no random source for the key secret")?;
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.as_str(), fresh.expose(), None)]);
        tokio::time::timeout(ETCD_TIMEOUT, c.txn(txn))
            .await
            .map_err(|_| format!("etcd create {key}: timed out"))?
            .map_err(|e| format!("etcd create {key}: {e}"))?;
        // Read back: another leader's may have won the race.
    }
    Err(format!("{key}: not readable after creating it"))
}
