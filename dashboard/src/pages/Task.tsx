// One task: live numbers, live and historical traffic, the edit form, dynamic adjustments and
// the hosts that use it.

import { useMemo, useState } from 'preact/hooks';
import {
  api,
  ApiError,
  get,
  taskPath,
  type Adjustment,
  type History,
  type Host,
  type Settings,
  type TaskSpec,
  type TaskWithStatus,
  type TopKey,
  type TopKeys,
} from '../api';
import { Chart, TRAFFIC_SERIES, WOULD_REJECT_SERIES } from '../components/Chart';
import { TaskForm } from '../components/TaskForm';
import { ErrorNote, NotAvailable, Section, Stat, StateBadge } from '../components/ui';
import { ago, dateTime, duration, num, num2, sliceLen } from '../format';
import { Link, navigate } from '../router';
import { usePoll } from '../poll';
import { FLUSH_LAG_MS, toColumns } from '../traffic';

const RANGES = [
  { id: '5m', label: '5 min', seconds: 300, resolution: '1s', every: 5000 },
  { id: '1h', label: '1 h', seconds: 3600, resolution: '1s', every: 15000 },
  { id: '24h', label: '24 h', seconds: 86400, resolution: '1m', every: 60000 },
];

function TrafficChart({ name, seconds, resolution, every, testId, label }: {
  name: string;
  seconds: number;
  resolution: string;
  every: number;
  testId: string;
  label: string;
}) {
  const { data, error } = usePoll(
    (s) => get<History>(`${taskPath(name)}/history?seconds=${seconds}&resolution=${resolution}`, s),
    every,
    [name, seconds, resolution],
  );
  const cols = useMemo(() => (data ? toColumns(data) : null), [data]);
  if (error?.missingEndpoint) return <NotAvailable>Traffic history is not available on this manager.</NotAvailable>;
  return (
    <div>
      <ErrorNote error={error} what="the traffic" />
      {cols ? (
        <>
          <Chart
            data={cols.data}
            series={cols.data.length > 4 ? [...TRAFFIC_SERIES, WOULD_REJECT_SERIES] : TRAFFIC_SERIES}
            yLabel="per second"
            label={`${label}: ${num(cols.admitted)} admitted and ${num(cols.rejected)} rejected${
              cols.wouldReject > 0 ? ` (${num(cols.wouldReject)} of them admitted by shadow mode)` : ''
            }`}
            testId={testId}
            xRange={data ? [data.from_ms / 1000, (data.now_ms - FLUSH_LAG_MS) / 1000] : undefined}
            attrs={{
              'data-admitted-total': cols.admitted,
              'data-rejected-total': cols.rejected,
              'data-would-reject-total': cols.wouldReject,
              'data-points': cols.points,
              'data-peak-admitted-per-s': Math.round(cols.peakAdmittedPerS),
              'data-low-admitted-per-s': Math.round(cols.lowAdmittedPerS),
            }}
          />
          <p class="muted small chart-foot">
            {num(cols.admitted)} admitted · {num(cols.rejected)} rejected
            {cols.wouldReject > 0 ? ` (${num(cols.wouldReject)} would-reject, admitted by shadow mode)` : ''} in{' '}
            {duration(seconds * 1000)}
            {cols.points === 0 ? ' — no slices in this range yet.' : ''}
            {data && data.resolution_ms !== data.slice_ms ? ` · ${sliceLen(data.resolution_ms)} buckets of ${sliceLen(data.slice_ms)} slices` : ''}
          </p>
        </>
      ) : (
        <div class="chart chart-empty" aria-hidden="true" />
      )}
    </div>
  );
}

function HistorySection({ name }: { name: string }) {
  const [range, setRange] = useState(RANGES[0]);
  const onKey = (e: KeyboardEvent) => {
    const i = RANGES.findIndex((r) => r.id === range.id);
    const next = e.key === 'ArrowRight' ? (i + 1) % RANGES.length : e.key === 'ArrowLeft' ? (i + RANGES.length - 1) % RANGES.length : -1;
    if (next >= 0) {
      e.preventDefault();
      setRange(RANGES[next]);
      document.getElementById(`range-${RANGES[next].id}`)?.focus();
    }
  };
  return (
    <Section
      title="History"
      id="history"
      actions={
        <div role="tablist" aria-label="History range" class="tabs" onKeyDown={onKey}>
          {RANGES.map((r) => (
            <button
              type="button"
              role="tab"
              id={`range-${r.id}`}
              aria-selected={r.id === range.id}
              aria-controls="history-panel"
              tabIndex={r.id === range.id ? 0 : -1}
              class={r.id === range.id ? 'tab active' : 'tab'}
              onClick={() => setRange(r)}
            >
              {r.label}
            </button>
          ))}
        </div>
      }
    >
      <div role="tabpanel" id="history-panel" aria-labelledby={`range-${range.id}`}>
        <TrafficChart
          key={range.id}
          name={name}
          seconds={range.seconds}
          resolution={range.resolution}
          every={range.every}
          testId="history-chart"
          label={`Traffic over ${range.label}`}
        />
      </div>
    </Section>
  );
}

function Adjustments({ name }: { name: string }) {
  const { data, error } = usePoll(
    (s) => get<{ adjustments: Adjustment[] }>(`${taskPath(name)}/adjustments`, s),
    5000,
    [name],
  );
  if (error?.missingEndpoint) {
    return <NotAvailable>Dynamic limiting adjustments are not available on this manager yet.</NotAvailable>;
  }
  const list = [...(data?.adjustments ?? [])].sort((a, b) => b.at_ms - a.at_ms);
  return (
    <>
      <ErrorNote error={error} what="the adjustments" />
      {data && list.length === 0 ? <p class="muted">No adjustments yet.</p> : null}
      {list.length > 0 ? (
        <div class="table-wrap scroll-y">
          <table data-testid="adjustments">
            <thead>
              <tr>
                <th scope="col">When</th>
                <th scope="col" class="num">
                  Threshold
                </th>
                <th scope="col">Reason</th>
              </tr>
            </thead>
            <tbody>
              {list.map((a) => (
                <tr>
                  <td>{dateTime(a.at_ms)}</td>
                  <td class="num">
                    {num(a.old)} → <strong>{num(a.new)}</strong>
                  </td>
                  <td>{a.reason}</td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      ) : null}
    </>
  );
}

function Hosts({ name }: { name: string }) {
  const { data, error } = usePoll(
    (s) => get<{ hosts: Host[]; now_ms: number }>(`/api/v1/hosts?task=${encodeURIComponent(name)}`, s),
    3000,
    [name],
  );
  const settings = usePoll((s) => get<Settings>('/api/v1/settings', s), 30000, []);
  const skew = settings.data?.skew_threshold_ms ?? 100;
  if (error?.missingEndpoint) return <NotAvailable>Host reports are not available on this manager.</NotAvailable>;
  const hosts = data?.hosts ?? [];
  return (
    <>
      <ErrorNote error={error} what="the hosts" />
      {data && hosts.length === 0 ? <p class="muted">No host has reported using this task.</p> : null}
      {hosts.length > 0 ? (
        <div class="table-wrap">
          <table data-testid="hosts">
            <thead>
              <tr>
                <th scope="col">Host</th>
                <th scope="col">State</th>
                <th scope="col" class="num">
                  Clock offset
                </th>
                <th scope="col">Last seen</th>
                <th scope="col" class="hide-narrow">
                  SDK
                </th>
              </tr>
            </thead>
            <tbody>
              {hosts.map((h) => {
                const off = h.offset_ms ?? 0;
                const skewed = Math.abs(off) > skew;
                return (
                  <tr class={h.stale ? 'stale' : ''}>
                    <td class="nowrap">{h.host_id}</td>
                    <td>{h.error ? <span class="bad-text">{h.error}</span> : <StateBadge state={h.tasks?.[name] ?? 'unknown'} />}</td>
                    <td
                      class={`num${skewed ? ' bad-text' : ''}`}
                      title={`host clock − Redis time; measured with a ${h.rtt_ms === undefined ? '?' : num2(h.rtt_ms)} ms round trip${skewed ? `; beyond the skew threshold (${skew} ms)` : ''}`}
                    >
                      {h.offset_ms === undefined ? '—' : signedMs(off)}
                      {h.rtt_ms !== undefined ? <span class="muted small"> ±{num2(h.rtt_ms / 2)}</span> : null}
                    </td>
                    <td class="nowrap">
                      {ago(h.age_ms)}
                      {h.stale ? <span class="muted small"> (stale)</span> : null}
                    </td>
                    <td class="hide-narrow muted">{h.sdk ?? '—'}</td>
                  </tr>
                );
              })}
            </tbody>
          </table>
        </div>
      ) : null}
    </>
  );
}

/** How often the task page reads the task (and a keyed task's top keys). */
const TASK_POLL_MS = 2000;

function TopKeyTable({ rows, label, testId, overrides }: {
  rows: TopKey[];
  label: string;
  testId: string;
  overrides: Record<string, number>;
}) {
  return (
    <div class="table-wrap">
      <table data-testid={testId} aria-label={label}>
        <caption class="small muted">{label}</caption>
        <thead>
          <tr>
            <th scope="col">Key</th>
            <th scope="col" class="num">
              Permits
            </th>
          </tr>
        </thead>
        <tbody>
          {rows.length === 0 ? (
            <tr>
              <td colSpan={2} class="muted">
                None in this window.
              </td>
            </tr>
          ) : (
            rows.map((r) => (
              <tr data-key={r.key}>
                <td class="key-cell">
                  {r.key}
                  {Object.prototype.hasOwnProperty.call(overrides, r.key) ? (
                    <span class="muted small"> (override {num(overrides[r.key])})</span>
                  ) : null}
                </td>
                <td class="num" data-col="permits">
                  {num(r.permits)}
                </td>
              </tr>
            ))
          )}
        </tbody>
      </table>
    </div>
  );
}

/** A keyed task: its overrides and busiest keys (by admitted and by rejected permits). */
function TopKeysSection({ name, t }: { name: string; t: TaskWithStatus }) {
  const { data, error } = usePoll((s) => get<TopKeys>(`${taskPath(name)}/keys`, s), TASK_POLL_MS, [name]);
  const overrides = t.key_overrides ?? {};
  const entries = Object.entries(overrides);
  return (
    <Section title="Top keys" id="top-keys">
      {error?.missingEndpoint ? <NotAvailable>Top keys are not available on this manager.</NotAvailable> : <ErrorNote error={error} what="the top keys" />}
      <p class="muted small">
        Every key has {num(t.threshold)} permits per {sliceLen(t.slice_ms)} slice
        {entries.length > 0 ? `, except ${entries.length} override${entries.length === 1 ? '' : 's'}` : ''}.
        {data ? ` Busiest keys of the last ${duration(data.window_ms)}, as hosts report them each second.` : ''}
      </p>
      {entries.length > 0 ? (
        <div class="table-wrap scroll-y">
          <table data-testid="key-overrides" aria-label="Key overrides">
            <thead>
              <tr>
                <th scope="col">Overridden key</th>
                <th scope="col" class="num">
                  Threshold
                </th>
              </tr>
            </thead>
            <tbody>
              {entries.map(([k, n]) => (
                <tr data-key={k}>
                  <td class="key-cell">{k}</td>
                  <td class="num">{num(n)}</td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      ) : null}
      {data ? (
        <div class="keys-cols">
          <TopKeyTable rows={data.top_admitted} label="By admitted" testId="top-admitted" overrides={overrides} />
          <TopKeyTable rows={data.top_rejected} label="By rejected" testId="top-rejected" overrides={overrides} />
        </div>
      ) : null}
      {data?.malformed_entries ? (
        <p class="muted small">{num(data.malformed_entries)} entries in Redis could not be read and are ignored.</p>
      ) : null}
    </Section>
  );
}

/** +3.25 ms, −120 ms, 0 ms. */
function signedMs(ms: number): string {
  const r = Math.round(ms * 100) / 100;
  if (r === 0) return '0 ms';
  return `${r > 0 ? '+' : '−'}${num2(Math.abs(r))} ms`;
}

function Summary({ t }: { t: TaskWithStatus }) {
  const st = t.status;
  const ahead = st.horizon_until_ms ? st.horizon_until_ms - Date.now() : null;
  return (
    <div class="stats">
      <Stat
        label="Threshold now"
        testId="threshold-now"
        value={num(st.effective_threshold ?? null)}
        hint={st.effective_threshold !== null && st.effective_threshold !== t.threshold ? `base ${num(t.threshold)}` : `per ${sliceLen(t.slice_ms)} slice`}
      />
      <Stat label="Remaining in this slice" value={num(st.remaining ?? null)} hint="not yet pulled by hosts" />
      <Stat
        label={st.lazy ? 'Decidable ahead' : 'Written ahead'}
        value={ahead === null ? '—' : duration(ahead)}
        hint={st.lazy ? 'idle, lazy: each slice is made by its first decision' : 'slices ready in Redis'}
      />
      <Stat
        label="Mode"
        value={t.mode}
        hint={`on Redis failure: ${t.on_failure}${t.pacing === 'smooth' ? ` · paced, burst ${num(t.burst ?? 0)}` : ''}`}
      />
      {t.shadow ? (
        <Stat
          label="Shadow mode"
          testId="would-reject"
          value={num(st.last_slice?.would_reject ?? null)}
          hint="would-rejects in the last slice: admitted, counted as if enforced"
        />
      ) : null}
    </div>
  );
}

/** Mode `concurrency`: in flight now against the threshold, from the task's lease hash. */
function ConcurrencySummary({ t }: { t: TaskWithStatus }) {
  const st = t.status;
  const cap = st.effective_threshold ?? null;
  const held = st.held ?? null;
  const expired = (st.hosts ?? []).filter((h) => h.expired).length;
  return (
    <div class="stats">
      <Stat
        label="In flight now"
        testId="in-flight"
        value={
          <>
            {num(held)}
            <span class="muted small"> / {num(cap ?? t.threshold)}</span>
          </>
        }
        hint="permits held cluster-wide / threshold"
      />
      <Stat
        label="Hosts holding"
        testId="hosts-holding"
        value={num(st.hosts_holding ?? null)}
        hint={`${num(st.hosts_waiting ?? null)} waiting for more`}
      />
      <Stat
        label="Expired leases"
        testId="expired-leases"
        value={num(st.hosts ? expired : null)}
        hint={`hosts whose lease ended holding permits (kept ${duration(10 * (t.lease_ms ?? 10000))})`}
      />
      <Stat label="Mode" value={t.mode} hint={`lease ${duration(t.lease_ms ?? 10000)} · on Redis failure: ${t.on_failure}`} />
    </div>
  );
}

/**
 * Mode `concurrency`: one row per host, joining its lease entry (held, expires in, waiting in
 * Redis) with its last report (in use, waiting callers, lapses) from `GET /api/v1/hosts`.
 */
function Leases({ name, t }: { name: string; t: TaskWithStatus }) {
  const reports = usePoll(
    (s) => get<{ hosts: Host[]; now_ms: number }>(`/api/v1/hosts?task=${encodeURIComponent(name)}`, s),
    3000,
    [name],
  );
  const leases = t.status.hosts ?? [];
  const byHost = new Map((reports.data?.hosts ?? []).map((h) => [h.host_id, h]));
  const ids = [...new Set([...leases.map((l) => l.host), ...byHost.keys()])].sort();
  const malformed = t.status.malformed_entries ?? 0;
  return (
    <>
      <ErrorNote error={reports.error?.missingEndpoint ? undefined : reports.error} what="the host reports" />
      {malformed > 0 ? (
        <p class="note error" data-testid="malformed">
          {num(malformed)} lease entr{malformed === 1 ? 'y' : 'ies'} in Redis could not be read and {malformed === 1 ? 'is' : 'are'} ignored.
        </p>
      ) : null}
      {ids.length === 0 ? <p class="muted">No host holds or has asked for permits.</p> : null}
      {ids.length > 0 ? (
        <div class="table-wrap">
          <table data-testid="leases">
            <thead>
              <tr>
                <th scope="col">Host</th>
                <th scope="col" class="num">
                  Held
                </th>
                <th scope="col" class="num">
                  In use
                </th>
                <th scope="col" class="num">
                  Waiting
                </th>
                <th scope="col" class="num">
                  Unmet
                </th>
                <th scope="col" class="num">
                  Lease expires in
                </th>
                <th scope="col" class="num hide-narrow">
                  Lapses
                </th>
              </tr>
            </thead>
            <tbody>
              {ids.map((id) => {
                const l = leases.find((x) => x.host === id);
                const p = byHost.get(id)?.permits?.[name];
                return (
                  <tr data-host={id} class={l?.expired ? 'stale' : ''}>
                    <td class="nowrap">{id}</td>
                    <td class="num" data-col="held">
                      {l ? num(l.held) : '—'}
                    </td>
                    <td class="num" data-col="in-use" title="from the host's last report">
                      {p ? `${num(p.in_use)} of ${num(p.limit)}` : '—'}
                    </td>
                    <td class={`num${p && p.waiting > 0 ? ' warn-text' : ''}`} data-col="waiting" title="callers waiting for a permit on the host (its last report)">
                      {p ? num(p.waiting) : '—'}
                    </td>
                    <td class={`num${l && l.waiting > 0 ? ' warn-text' : ''}`} data-col="unmet" title="permits the host asked Redis for at its last lease call and did not get">
                      {l ? num(l.waiting) : '—'}
                    </td>
                    <td class={`num${l?.expired ? ' bad-text' : ''}`} data-col="expires">
                      {!l ? '—' : l.expires_in_ms > 0 ? duration(l.expires_in_ms) : `expired ${duration(-l.expires_in_ms)} ago`}
                    </td>
                    <td class="num hide-narrow" data-col="lapses">
                      {p ? num(p.lapses) : '—'}
                    </td>
                  </tr>
                );
              })}
            </tbody>
          </table>
        </div>
      ) : null}
      <p class="muted small">
        Held, unmet and lease times are Redis' (live); in use, waiting callers and lapses are each host's last report.
      </p>
    </>
  );
}

export function TaskPage({ name }: { name: string }) {
  const task = usePoll((s) => get<TaskWithStatus>(taskPath(name), s), TASK_POLL_MS, [name]);
  const [deleting, setDeleting] = useState(false);
  const [delError, setDelError] = useState<ApiError | null>(null);

  if (task.error?.status === 404 && !task.error.missingEndpoint) {
    return (
      <div class="page">
        <h1>Task “{name}”</h1>
        <p class="note error" role="alert">
          There is no task named “{name}”. <Link href="/">Back to the tasks</Link>
        </p>
      </div>
    );
  }
  const t = task.data;
  const del = async () => {
    if (!confirm(`Delete task “${name}”? Hosts using it fall back to their failure behaviour.`)) return;
    setDeleting(true);
    setDelError(null);
    try {
      await api('DELETE', taskPath(name));
      navigate('/');
    } catch (e) {
      if (e instanceof ApiError) setDelError(e);
    } finally {
      setDeleting(false);
    }
  };
  const onSaved = (_s: TaskSpec) => task.refresh();

  return (
    <div class="page">
      <div class="page-head">
        <div>
          <p class="crumbs">
            <Link href="/">Tasks</Link> /
          </p>
          <h1>{name}</h1>
          {t?.description ? <p class="muted">{t.description}</p> : null}
        </div>
        <button type="button" class="danger" onClick={del} disabled={deleting || !t}>
          {deleting ? 'Deleting…' : 'Delete task'}
        </button>
      </div>
      {delError ? (
        <p class="note error" role="alert">
          Could not delete: {delError.message}
        </p>
      ) : null}
      <ErrorNote error={task.error} what="the task" />
      {t?.status.error ? <p class="note error">Live status unavailable: {t.status.error}</p> : null}
      {t ? t.mode === 'concurrency' ? <ConcurrencySummary t={t} /> : <Summary t={t} /> : <p class="muted">Loading…</p>}

      {t?.mode === 'concurrency' ? (
        <Section title="Permits by host" id="leases">
          <Leases name={name} t={t} />
        </Section>
      ) : (
        <>
          <Section title="Live traffic (last 60 s)" id="live">
            <TrafficChart name={name} seconds={60} resolution="1s" every={1000} testId="live-chart" label="Live traffic" />
          </Section>

          <HistorySection name={name} />
        </>
      )}

      {t?.keyed ? <TopKeysSection name={name} t={t} /> : null}

      <div class="two-col">
        <Section title="Settings" id="settings">
          {t ? <TaskForm key={name} spec={t} onSaved={onSaved} onReload={task.refresh} /> : <p class="muted">Loading…</p>}
        </Section>
        <div class="stack">
          <Section title="Dynamic adjustments" id="adjustments">
            {t?.dynamic?.enabled ? null : <p class="muted small">Dynamic limiting is off for this task.</p>}
            <Adjustments name={name} />
          </Section>
          <Section title="Hosts using this task" id="hosts">
            <Hosts name={name} />
          </Section>
        </div>
      </div>
    </div>
  );
}
