//! Leader election through etcd's election API, with a lease this replica must keep proving.
//!
//! ```text
//!            grant lease ──▶ register /NS/members/<id> ──▶ campaign /NS/election
//!                 ▲                                               │ elected
//!                 │                                               ▼
//!   lease lost /  │                                  first keep-alive confirmed
//!   fenced /      │                                  after the campaign returned
//!   deadline ─────┤                                               │
//!                 │                                               ▼
//!                 └──── stop leader work ◀──── LEADER: leader-only work runs
//!                        (resign, revoke)         until valid_until − margin
//! ```
//!
//! # Why leadership is bounded by the lease
//!
//! A keep-alive sent at `t` and answered with `ttl > 0` proves the lease lives until at least
//! `t + ttl` (the server restarts the TTL when it *receives* the request, after `t`). So the
//! replica knows a `valid_until`, and leader-only work must stop before it: at
//! `valid_until − margin`. Keep-alives go out every TTL/3; one that fails or times out is
//! retried within a quarter of a second: a single lost keep-alive is not an abdication. Only when
//! `valid_until` passes without a newer proof (or etcd answers `ttl ≤ 0`) does the replica step
//! down. A paused process (SIGSTOP) wakes with `valid_until` long past, so it stops at once; a
//! write already in flight is refused by the Redis fence (see `sluice_protocol::scripts`).
//!
//! # Term and epoch
//!
//! The term is the leader key's creation revision: it grows with every election. Revisions
//! only order elections of one etcd history, so the leader also carries its **epoch**, the
//! cluster id etcd puts in every response header: the fence it writes with
//! ([`sluice_protocol::scripts::Fence`]) is `(term, epoch, stale_after)`. A fence of another
//! epoch (another etcd, another manager cluster on the same namespace) is never compared by
//! term: it is refused while its holder keeps it fresh and taken over once it went stale.
//!
//! A rebuilt etcd with the same configuration has the same cluster id (etcd derives it from
//! the member names and peer URLs) but starts its revisions again. A stored term above every
//! revision this etcd has reached ([`LeaderContext::from_this_history`]) cannot come from a
//! leader of this history, so it is not a reason to step down either: such a refusal is
//! treated like a foreign one.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, GetOptions, LeaseKeepAliveStream, LeaseKeeper, PutOptions, ResignOptions,
};
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use sluice_protocol::Keys;
use sluice_protocol::scripts::Fence;
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::error::{Result, etcd};
use crate::metrics::Metrics;

/// Bound on one unary etcd request.
pub const ETCD_TIMEOUT: Duration = Duration::from_secs(2);

/// This replica's role, as the rest of the process sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Not the leader (or not sure to be).
    Follower,
    /// The leader with this term.
    Leader {
        /// Election term (leader key creation revision).
        term: i64,
    },
}

/// The value stored under the leader key and the member keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Node id.
    pub node_id: String,
    /// Advertised HTTP address.
    pub addr: String,
    /// When the replica started (Unix ms).
    #[serde(default)]
    pub started_ms: i64,
}

/// What the lease is known to be.
#[derive(Debug, Clone, Copy)]
struct LeaseState {
    /// The lease lives at least until then.
    valid_until: Instant,
    /// Send time of the newest confirmed keep-alive.
    confirmed_at: Option<Instant>,
    /// The highest etcd revision seen in a response header (keep-alives, the election).
    revision: i64,
}

/// Handed to leader-only work: the term to write with, and the means to know when to stop.
#[derive(Debug, Clone)]
pub struct LeaderContext {
    term: i64,
    epoch: u64,
    stale_after: Duration,
    token: CancellationToken,
    lease: watch::Receiver<LeaseState>,
    margin: Duration,
    step_down: mpsc::UnboundedSender<String>,
}

impl LeaderContext {
    /// The election term.
    pub fn term(&self) -> i64 {
        self.term
    }

    /// The epoch: the cluster id of the etcd that elected this leader.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The fence every leader write carries.
    pub fn fence(&self) -> Fence {
        Fence {
            term: self.term,
            epoch: self.epoch,
            stale_after_ms: self.stale_after.as_millis() as u64,
        }
    }

    /// How long a fence may go unrefreshed before another leader may take it over.
    pub fn stale_after(&self) -> Duration {
        self.stale_after
    }

    /// The highest etcd revision this replica has seen (refreshed by every keep-alive).
    pub fn known_revision(&self) -> i64 {
        self.lease.borrow().revision.max(self.term)
    }

    /// Whether a stored `term` of our epoch can have been written by a leader of this etcd's
    /// history: false when it is above every revision this etcd has reached (etcd was rebuilt
    /// or restored from a snapshot, and its revisions started again below it).
    pub fn from_this_history(&self, term: i64) -> bool {
        term <= self.known_revision()
    }

    /// Cancelled when leadership ends.
    pub fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// True while this replica may act as leader: not cancelled, and the lease is proven alive
    /// past now + margin. Check it right before every write.
    pub fn is_valid(&self) -> bool {
        !self.token.is_cancelled() && Instant::now() + self.margin < self.lease.borrow().valid_until
    }

    /// Asks the election loop to end this leadership (e.g. after being fenced).
    pub fn step_down(&self, reason: impl Into<String>) {
        let _ = self.step_down.send(reason.into());
    }

    /// A context for tests of leader-only work: valid for `valid_for`, never renewed, epoch
    /// `epoch`, fences stale after 10 s.
    pub fn for_test(
        term: i64,
        epoch: u64,
        valid_for: Duration,
    ) -> (Self, mpsc::UnboundedReceiver<String>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let (_, lease) = watch::channel(LeaseState {
            valid_until: Instant::now() + valid_for,
            confirmed_at: Some(Instant::now()),
            revision: term,
        });
        (
            Self {
                term,
                epoch,
                stale_after: Duration::from_secs(10),
                token: CancellationToken::new(),
                lease,
                margin: Duration::ZERO,
                step_down: tx,
            },
            rx,
        )
    }
}

/// Leader-only work: started on election, given a context, stopped when it is cancelled.
pub type LeaderWork = Arc<dyn Fn(LeaderContext) -> BoxFuture<'static, ()> + Send + Sync>;

/// Settings of the election loop.
#[derive(Debug, Clone)]
pub struct ElectionConfig {
    /// Key builder.
    pub keys: Keys,
    /// This node.
    pub node: NodeInfo,
    /// Lease TTL (whole seconds).
    pub ttl: Duration,
    /// How long a stored fence may go unrefreshed before it may be taken over.
    pub fence_stale_after: Duration,
}

impl ElectionConfig {
    /// Safety margin: leader work stops this long before the lease could expire.
    pub fn margin(&self) -> Duration {
        (self.ttl / 6).max(Duration::from_millis(200))
    }
}

/// A granted lease with its keep-alive task.
struct Session {
    lease: i64,
    state: watch::Receiver<LeaseState>,
    kick: Arc<Notify>,
    lost: CancellationToken,
    stop: CancellationToken,
}

impl Session {
    async fn start(client: &Client, ttl: Duration) -> Result<Self> {
        let mut c = client.clone();
        let sent = Instant::now();
        let grant = etcd(
            "lease grant",
            ETCD_TIMEOUT,
            c.lease_grant(ttl.as_secs() as i64, None),
        )
        .await?;
        let granted = Duration::from_secs(grant.ttl().max(0) as u64);
        let (tx, state) = watch::channel(LeaseState {
            valid_until: sent + granted,
            confirmed_at: None,
            revision: grant.header().map_or(0, |h| h.revision()),
        });
        let s = Self {
            lease: grant.id(),
            state,
            kick: Arc::new(Notify::new()),
            lost: CancellationToken::new(),
            stop: CancellationToken::new(),
        };
        let span = info_span!("lease", id = format_args!("{:x}", s.lease));
        tokio::spawn(
            keep_alive_loop(
                client.clone(),
                s.lease,
                granted.max(Duration::from_secs(1)),
                tx,
                s.kick.clone(),
                s.lost.clone(),
                s.stop.clone(),
            )
            .instrument(span),
        );
        Ok(s)
    }

    /// Waits for a keep-alive sent after `after` to be confirmed; false if the lease is lost
    /// or `bound` passes first.
    async fn confirmed_after(&mut self, after: Instant, bound: Duration) -> bool {
        self.kick.notify_one();
        let deadline = Instant::now() + bound;
        loop {
            if self.state.borrow().confirmed_at.is_some_and(|t| t >= after) {
                return true;
            }
            tokio::select! {
                _ = self.lost.cancelled() => return false,
                _ = sleep_until(deadline) => return false,
                r = self.state.changed() => if r.is_err() { return false },
            }
        }
    }

    /// Stops keep-alives and revokes the lease in the background (deleting our keys at once
    /// rather than after the TTL). Retried for a while: after an etcd outage the server
    /// restores leases with a fresh TTL, and revoking ours then lets a new election happen at
    /// once instead of one TTL later.
    fn abandon(self, client: &Client, ttl: Duration) {
        self.stop.cancel();
        let mut c = client.clone();
        let lease = self.lease;
        tokio::spawn(async move {
            let until = Instant::now() + (ttl * 2).max(Duration::from_secs(60));
            while Instant::now() < until {
                match etcd("lease revoke", ETCD_TIMEOUT, c.lease_revoke(lease)).await {
                    Ok(_) => return,
                    Err(e) if e.to_string().contains("not found") => return,
                    Err(e) => debug!(%e, "revoking old lease"),
                }
                sleep(Duration::from_millis(250)).await;
            }
        });
    }
}

async fn keep_alive_loop(
    mut client: Client,
    lease: i64,
    ttl: Duration,
    tx: watch::Sender<LeaseState>,
    kick: Arc<Notify>,
    lost: CancellationToken,
    stop: CancellationToken,
) {
    let period = ttl / 3;
    let retry = (period / 4).max(Duration::from_millis(50));
    let mut stream: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
    let mut next = Instant::now() + period;
    loop {
        let valid_until = tx.borrow().valid_until;
        if Instant::now() >= valid_until {
            warn!("lease can no longer be proven alive");
            lost.cancel();
            return;
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = sleep_until(next) => {}
            _ = kick.notified() => {}
            _ = sleep_until(valid_until) => continue,
        }
        let sent = Instant::now();
        let attempt = async {
            if stream.is_none() {
                stream = Some(client.lease_keep_alive(lease).await?);
            }
            let Some((keeper, responses)) = stream.as_mut() else {
                return Ok(None);
            };
            keeper.keep_alive().await?;
            responses.message().await
        };
        match timeout(period.max(Duration::from_millis(200)), attempt).await {
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => {
                let proven = sent + Duration::from_secs(resp.ttl() as u64);
                let revision = resp.header().map_or(0, |h| h.revision());
                tx.send_modify(|s| {
                    s.valid_until = s.valid_until.max(proven);
                    s.confirmed_at = Some(sent);
                    s.revision = s.revision.max(revision);
                });
                next = sent + period;
            }
            Ok(Ok(Some(_))) => {
                warn!("etcd says the lease has expired");
                lost.cancel();
                return;
            }
            other => {
                match other {
                    Ok(Err(e)) => warn!(%e, "keep-alive failed; retrying"),
                    Ok(Ok(None)) => warn!("keep-alive stream closed; retrying"),
                    _ => warn!("keep-alive timed out; retrying"),
                }
                // A response of a timed-out request could otherwise be read as the answer to
                // the next one, with a later send time: start a new stream.
                stream = None;
                next = Instant::now() + retry;
            }
        }
    }
}

/// How a leadership ended.
#[derive(Debug)]
enum Exit {
    Shutdown,
    LeaseLost,
    Deadline,
    SteppedDown(String),
}

/// Runs the election loop until `shutdown` is cancelled; runs `work` while leader.
pub async fn run(
    client: Client,
    cfg: ElectionConfig,
    work: LeaderWork,
    role: watch::Sender<Role>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let election = cfg.keys.etcd_election();
    let member_key = cfg.keys.etcd_member(&cfg.node.node_id);
    let value = serde_json::to_vec(&cfg.node).unwrap_or_default();
    let margin = cfg.margin();
    let mut backoff = Duration::from_millis(100);

    'session: while !shutdown.is_cancelled() {
        let mut session = match Session::start(&client, cfg.ttl).await {
            Ok(s) => s,
            Err(e) => {
                warn!(%e, ?backoff, "cannot get an etcd lease; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        let mut c = client.clone();
        let put = c.put(
            member_key.as_str(),
            value.clone(),
            Some(PutOptions::new().with_lease(session.lease)),
        );
        if let Err(e) = etcd("register member", ETCD_TIMEOUT, put).await {
            warn!(%e, "cannot register as member; retrying");
            session.abandon(&client, cfg.ttl);
            sleep(backoff).await;
            continue;
        }
        backoff = Duration::from_millis(100);
        info!(lease = format_args!("{:x}", session.lease), "campaigning");

        let campaign = c.campaign(election.as_str(), value.clone(), session.lease);
        let (leader_key, epoch) = tokio::select! {
            r = campaign => match r {
                Ok(resp) => match resp.leader() {
                    Some(k) => (k.clone(), resp.header().map_or(0, |h| h.cluster_id())),
                    None => {
                        warn!("campaign returned no leader key");
                        session.abandon(&client, cfg.ttl);
                        continue 'session;
                    }
                },
                Err(e) => {
                    warn!(%e, "campaign failed; starting over");
                    session.abandon(&client, cfg.ttl);
                    sleep(backoff).await;
                    continue 'session;
                }
            },
            _ = session.lost.cancelled() => {
                session.abandon(&client, cfg.ttl);
                continue 'session;
            }
            _ = shutdown.cancelled() => {
                session.abandon(&client, cfg.ttl);
                break 'session;
            }
        };

        // Elected. Leadership counts only once a keep-alive sent after this point is confirmed
        // and etcd names our key as the leader.
        let elected_at = Instant::now();
        if !session.confirmed_after(elected_at, cfg.ttl).await {
            warn!("elected, but the lease could not be confirmed; starting over");
            session.abandon(&client, cfg.ttl);
            continue;
        }
        match etcd("leader", ETCD_TIMEOUT, c.leader(election.as_str())).await {
            Ok(r)
                if r.kv().is_some_and(|kv| kv.key() == leader_key.key())
                    && r.header().is_some_and(|h| h.cluster_id() == epoch) =>
            {
                // The keep-alive confirmed above was answered after our key was created, so
                // the known revision already covers our term.
            }
            other => {
                warn!(
                    ?other,
                    "elected, but etcd names another leader; starting over"
                );
                session.abandon(&client, cfg.ttl);
                continue;
            }
        }

        let term = leader_key.rev();
        let span = info_span!("leader", term);
        info!(parent: &span, epoch, "became leader");
        metrics.set_leader(Some(term));
        role.send_replace(Role::Leader { term });
        let token = CancellationToken::new();
        let (down_tx, mut down_rx) = mpsc::unbounded_channel();
        let ctx = LeaderContext {
            term,
            epoch,
            stale_after: cfg.fence_stale_after,
            token: token.clone(),
            lease: session.state.clone(),
            margin,
            step_down: down_tx,
        };
        let mut handle = tokio::spawn(work(ctx).instrument(span.clone()));

        let exit = loop {
            let stop_at = session.state.borrow().valid_until - margin;
            tokio::select! {
                _ = shutdown.cancelled() => break Exit::Shutdown,
                _ = session.lost.cancelled() => break Exit::LeaseLost,
                Some(r) = down_rx.recv() => break Exit::SteppedDown(r),
                _ = sleep_until(stop_at) => {
                    if Instant::now() >= session.state.borrow().valid_until - margin {
                        break Exit::Deadline;
                    }
                }
                r = session.state.changed() => if r.is_err() { break Exit::LeaseLost },
                _ = &mut handle => {
                    // Leader work should only end when cancelled; restart the election.
                    break Exit::SteppedDown("leader work ended".into());
                }
            }
        };

        token.cancel();
        if !handle.is_finished() && timeout(margin, &mut handle).await.is_err() {
            handle.abort();
        }
        role.send_replace(Role::Follower);
        metrics.set_leader(None);
        info!(parent: &span, ?exit, "stopped leading");

        match exit {
            Exit::Shutdown => {
                let resign = c.resign(Some(ResignOptions::new().with_leader(leader_key)));
                if let Err(e) = etcd("resign", ETCD_TIMEOUT, resign).await {
                    warn!(%e, "resign failed; the lease revoke below ends the term anyway");
                }
                session.stop.cancel();
                if let Err(e) =
                    etcd("lease revoke", ETCD_TIMEOUT, c.lease_revoke(session.lease)).await
                {
                    warn!(%e, "lease revoke failed; followers take over after the TTL");
                }
                return;
            }
            Exit::SteppedDown(reason) => {
                info!(reason, "stepping down: resigning");
                let resign = c.resign(Some(ResignOptions::new().with_leader(leader_key)));
                let _ = etcd("resign", ETCD_TIMEOUT, resign).await;
                session.abandon(&client, cfg.ttl);
            }
            Exit::LeaseLost | Exit::Deadline => session.abandon(&client, cfg.ttl),
        }
    }
    // Shutdown as a follower: the abandoned session revokes its lease in the background; give
    // it a moment so the member key disappears now rather than after the TTL.
    let mut c = client.clone();
    let _ = etcd(
        "deregister",
        Duration::from_millis(500),
        c.delete(member_key.as_str(), None),
    )
    .await;
}

/// The cluster as etcd sees it.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterView {
    /// The current leader, if any.
    pub leader: Option<LeaderView>,
    /// Registered members.
    pub members: Vec<MemberView>,
}

/// The leader in [`ClusterView`].
#[derive(Debug, Clone, Serialize)]
pub struct LeaderView {
    /// Node id.
    pub node_id: String,
    /// Address.
    pub addr: String,
    /// Term.
    pub term: i64,
}

/// A member in [`ClusterView`].
#[derive(Debug, Clone, Serialize)]
pub struct MemberView {
    /// Node id.
    pub node_id: String,
    /// Address.
    pub addr: String,
    /// Whether it is the leader.
    pub is_leader: bool,
    /// When it started (Unix ms).
    pub started_ms: i64,
}

/// Reads the leader and the members from etcd.
pub async fn cluster_view(client: &Client, keys: &Keys) -> Result<ClusterView> {
    let mut c = client.clone();
    let leader = match etcd("leader", ETCD_TIMEOUT, c.leader(keys.etcd_election())).await {
        Ok(r) => r.kv().and_then(|kv| {
            let n: NodeInfo = serde_json::from_slice(kv.value()).ok()?;
            Some(LeaderView {
                node_id: n.node_id,
                addr: n.addr,
                term: kv.create_revision(),
            })
        }),
        // etcd answers "election: no leader" as an error.
        Err(e) if e.to_string().contains("no leader") => None,
        Err(e) => return Err(e),
    };
    let prefix = keys.etcd_members_prefix();
    let resp = etcd(
        "list members",
        ETCD_TIMEOUT,
        c.get(prefix.as_str(), Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let mut members: Vec<MemberView> = resp
        .kvs()
        .iter()
        .filter_map(|kv| serde_json::from_slice::<NodeInfo>(kv.value()).ok())
        .map(|n| MemberView {
            is_leader: leader.as_ref().is_some_and(|l| l.node_id == n.node_id),
            node_id: n.node_id,
            addr: n.addr,
            started_ms: n.started_ms,
        })
        .collect();
    members.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    Ok(ClusterView { leader, members })
}
