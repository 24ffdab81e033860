//! HTTPS for the manager's own listener (`--tls-cert`, `--tls-key`): a [`Listener`] for
//! `axum::serve` that hands out TLS streams.
//!
//! Handshakes run concurrently in their own tasks, each bounded by [`HANDSHAKE_TIMEOUT`], so
//! a client that connects and says nothing (or speaks plain HTTP) never holds up the others.
//! A failed handshake is logged at DEBUG (a plain-HTTP probe would otherwise fill the log).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::Listener;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tracing::{debug, warn};

/// Bound on one TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// At most this many handshakes in flight; more connections wait in the kernel's backlog.
const MAX_HANDSHAKES: usize = 256;

/// A TLS listener: TCP accepts and handshakes run in a background task.
pub struct TlsListener {
    local: SocketAddr,
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    _accept: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    /// Serves TLS with `config` on `tcp`.
    pub fn new(tcp: TcpListener, config: rustls::ServerConfig) -> std::io::Result<Self> {
        let local = tcp.local_addr()?;
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let (tx, ready) = mpsc::channel(64);
        let accept = tokio::spawn(accept_loop(tcp, acceptor, tx));
        Ok(Self {
            local,
            ready,
            _accept: accept,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self._accept.abort();
    }
}

async fn accept_loop(
    tcp: TcpListener,
    acceptor: TlsAcceptor,
    tx: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let (stream, peer) = match tcp.accept().await {
            Ok(c) => c,
            Err(e) => {
                // As axum does: resource exhaustion (EMFILE) passes; do not spin.
                warn!(%e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let acceptor = acceptor.clone();
        if tx.is_closed() {
            return;
        }
        let ready = tx.clone();
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => {
                    let _ = ready.send((tls, peer)).await;
                }
                Ok(Err(e)) => debug!(%peer, %e, "TLS handshake failed"),
                Err(_) => debug!(%peer, "TLS handshake timed out"),
            }
        });
    }
}

impl Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The accept task only ends when this listener is dropped: never here.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
