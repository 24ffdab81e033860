// Cluster: the manager replicas, the leader and its term, and how far ahead slices are written.

import { get, type ClusterView, type Traffic } from '../api';
import { Badge, ErrorNote, Section, Stat } from '../components/ui';
import { duration, dateTime } from '../format';
import { Link } from '../router';
import { usePoll } from '../poll';

/**
 * Tasks whose horizon is shown: the first ones by name. The traffic of every task would cost a
 * few Redis reads per task every few seconds (100,000 tasks: too many); the leader's
 * `sluice_horizon_ahead_seconds` is the least over all of them.
 */
const HORIZON_TASKS = 1000;

export function ClusterPage() {
  const cluster = usePoll((s) => get<ClusterView>('/api/v1/cluster', s), 2000, []);
  const traffic = usePoll((s) => get<Traffic>(`/api/v1/traffic?limit=${HORIZON_TASKS}`, s), 3000, []);
  const partial = Boolean(traffic.data?.next);
  const c = cluster.data;
  const now = Date.now();
  const horizons = Object.entries(traffic.data?.tasks ?? {})
    .map(([name, t]) => ({ name, ahead: t.horizon_until_ms ? t.horizon_until_ms - (traffic.data?.now_ms ?? now) : null }))
    .sort((a, b) => (a.ahead ?? -Infinity) - (b.ahead ?? -Infinity));
  const known = horizons.filter((h) => h.ahead !== null).map((h) => h.ahead as number);
  const minAhead = known.length ? Math.min(...known) : null;

  return (
    <div class="page">
      <div class="page-head">
        <h1>Cluster</h1>
      </div>
      <ErrorNote error={cluster.error} what="the cluster" />
      {c ? (
        <div class="stats">
          <Stat
            label="Leader"
            testId="leader"
            value={c.leader ? c.leader.node_id : <span class="bad-text">none</span>}
            hint={c.leader ? c.leader.addr : 'an election is under way, or etcd is unreachable'}
          />
          <Stat label="Term" testId="term" value={c.leader ? String(c.leader.term) : '—'} hint="grows with every election" />
          <Stat label="Replicas" value={String(c.members.length)} hint={c.self ? `this page: ${c.self.node_id}` : undefined} />
          <Stat
            label="Written ahead"
            testId="horizon"
            value={minAhead === null ? '—' : duration(minAhead)}
            hint={
              known.length
                ? `least over ${known.length} task${known.length === 1 ? '' : 's'}${partial ? ` (the first ${HORIZON_TASKS} by name)` : ''}`
                : 'no tasks'
            }
          />
        </div>
      ) : cluster.loading ? (
        <p class="muted">Loading…</p>
      ) : null}
      {c ? (
        <Section title="Replicas" id="replicas">
          <div class="table-wrap">
            <table data-testid="members">
              <thead>
                <tr>
                  <th scope="col">Node</th>
                  <th scope="col">Address</th>
                  <th scope="col">Role</th>
                  <th scope="col" class="hide-narrow">
                    Started
                  </th>
                </tr>
              </thead>
              <tbody>
                {c.members.map((m) => (
                  <tr data-node={m.node_id}>
                    <td>
                      {m.node_id}
                      {c.self?.node_id === m.node_id ? <span class="muted small"> (this page)</span> : null}
                    </td>
                    <td>
                      {/* Replicas share one scheme: an https:// page links its peers over https://. */}
                      <a href={`${window.location.protocol}//${m.addr}/`}>{m.addr}</a>
                    </td>
                    <td>{m.is_leader ? <Badge kind="ok">leader</Badge> : <Badge kind="muted">follower</Badge>}</td>
                    <td class="hide-narrow muted">
                      {m.started_ms ? `${dateTime(m.started_ms)} (up ${duration(now - m.started_ms)})` : '—'}
                    </td>
                  </tr>
                ))}
              </tbody>
            </table>
          </div>
        </Section>
      ) : null}
      <Section title="Horizon by task" id="horizons">
        <p class="hint">
          The leader keeps every task's slices written ahead; a leader change or an etcd outage shorter than this costs
          nothing.
          {partial
            ? ` Shown for the first ${HORIZON_TASKS} tasks by name; the leader's metric sluice_horizon_ahead_seconds is the least over all of them.`
            : ''}
        </p>
        <ErrorNote error={traffic.error} what="the horizon" />
        {horizons.length === 0 && traffic.data ? <p class="muted">No tasks.</p> : null}
        {horizons.length > 0 ? (
          <div class="table-wrap">
            <table data-testid="horizons">
              <thead>
                <tr>
                  <th scope="col">Task</th>
                  <th scope="col" class="num">
                    Written ahead
                  </th>
                </tr>
              </thead>
              <tbody>
                {horizons.slice(0, 50).map((h) => (
                  <tr>
                    <td>
                      <Link href={`/tasks/${encodeURIComponent(h.name)}`}>{h.name}</Link>
                    </td>
                    <td class={`num${h.ahead !== null && h.ahead < 5000 ? ' bad-text' : ''}`}>{duration(h.ahead)}</td>
                  </tr>
                ))}
              </tbody>
            </table>
            {horizons.length > 50 ? <p class="muted small">…and {horizons.length - 50} more.</p> : null}
          </div>
        ) : null}
      </Section>
    </div>
  );
}
