// Tasks: every task with its threshold now, traffic and state; search; a way to create one.

import { useState } from 'preact/hooks';
import { ApiError, get, type TaskSpec, type TaskTraffic, type Traffic } from '../api';
import { Badge, ErrorNote } from '../components/ui';
import { duration, num, sliceLen } from '../format';
import { Link } from '../router';
import { usePoll } from '../poll';

interface Data {
  tasks: TaskSpec[];
  traffic?: Traffic;
  trafficError?: ApiError;
}

async function load(signal: AbortSignal): Promise<Data> {
  const [tasks, traffic] = await Promise.allSettled([
    get<{ tasks: TaskSpec[] }>('/api/v1/tasks', signal),
    get<Traffic>('/api/v1/traffic', signal),
  ]);
  if (tasks.status === 'rejected') throw tasks.reason;
  return {
    tasks: tasks.value.tasks,
    traffic: traffic.status === 'fulfilled' ? traffic.value : undefined,
    trafficError: traffic.status === 'rejected' ? (traffic.reason as ApiError) : undefined,
  };
}

/** The task's state from its hosts' reports (and its traffic when no host reports). */
export function taskState(t?: TaskTraffic): { kind: string; text: string; title: string } {
  if (!t) return { kind: 'muted', text: 'unknown', title: 'No traffic data' };
  const h = t.hosts ?? {};
  const total = Object.values(h).reduce((a, b) => a + b, 0);
  const hostsText = (n: number) => `${n} of ${total} host${total === 1 ? '' : 's'}`;
  if (h.failed) return { kind: 'bad', text: `failed on ${hostsText(h.failed)}`, title: 'Hosts are limiting locally: the global quota is unreachable' };
  if (h.limited) return { kind: 'warn', text: `limited on ${hostsText(h.limited)}`, title: 'Hosts found the slice exhausted' };
  if (total > 0) return { kind: 'ok', text: `normal (${total} host${total === 1 ? '' : 's'})`, title: 'Every reporting host is NORMAL' };
  if (t.rejected_per_s > 0) return { kind: 'warn', text: 'limiting', title: 'Requests are being rejected' };
  if (t.admitted_per_s > 0) return { kind: 'ok', text: 'active', title: 'Traffic, no host reports' };
  return { kind: 'muted', text: 'idle', title: 'No traffic in the last seconds' };
}

export function TasksPage() {
  const [q, setQ] = useState(() => new URLSearchParams(location.search).get('q') ?? '');
  const { data, error, loading } = usePoll(load, 2000, []);
  const needle = q.trim().toLowerCase();
  const tasks = (data?.tasks ?? []).filter(
    (t) => !needle || t.name.toLowerCase().includes(needle) || t.description.toLowerCase().includes(needle),
  );
  const onSearch = (v: string) => {
    setQ(v);
    const u = new URL(location.href);
    if (v) u.searchParams.set('q', v);
    else u.searchParams.delete('q');
    history.replaceState(null, '', u.pathname + u.search);
  };
  return (
    <div class="page">
      <div class="page-head">
        <h1>Tasks</h1>
        <Link href="/new" class="button">
          New task
        </Link>
      </div>
      <div class="toolbar">
        <label for="task-search" class="sr-only">
          Search tasks
        </label>
        <input
          id="task-search"
          type="search"
          placeholder="Search by name or description"
          value={q}
          onInput={(e) => onSearch(e.currentTarget.value)}
        />
        <span class="muted small" aria-live="polite">
          {data ? `${tasks.length} of ${data.tasks.length} task${data.tasks.length === 1 ? '' : 's'}` : ''}
        </span>
      </div>
      <ErrorNote error={error} what="the tasks" />
      {data?.trafficError && !data.trafficError.unreachable ? (
        <p class="note muted">Live traffic is not available: {data.trafficError.message}</p>
      ) : null}
      {loading && !data ? <p class="muted">Loading…</p> : null}
      {data && data.tasks.length === 0 ? (
        <div class="empty">
          <p>No tasks yet.</p>
          <Link href="/new" class="button">
            Create the first task
          </Link>
        </div>
      ) : null}
      {data && data.tasks.length > 0 ? (
        <div class="table-wrap">
          <table class="tasks" data-testid="tasks-table">
            <thead>
              <tr>
                <th scope="col">Task</th>
                <th scope="col" class="num">
                  Threshold now
                </th>
                <th scope="col" class="num">
                  Admitted/s
                </th>
                <th scope="col" class="num">
                  Rejected/s
                </th>
                <th scope="col">State</th>
                <th scope="col" class="hide-narrow">
                  Slice · mode
                </th>
              </tr>
            </thead>
            <tbody>
              {tasks.map((t) => {
                const tr = data.traffic?.tasks[t.name];
                const st = taskState(tr);
                const now = tr?.threshold ?? null;
                return (
                  <tr key={t.name} data-task={t.name}>
                    <td class="task-cell">
                      <Link href={`/tasks/${encodeURIComponent(t.name)}`} class="task-link">
                        {t.name}
                      </Link>
                      {t.description ? <div class="muted small">{t.description}</div> : null}
                    </td>
                    <td
                      class="num"
                      data-label="Threshold now"
                      title={now !== null && now !== t.threshold ? `base threshold ${num(t.threshold)}` : undefined}
                    >
                      {num(now ?? t.threshold)}
                      {now !== null && now !== t.threshold ? <span class="muted small"> (base {num(t.threshold)})</span> : null}
                      {t.mode === 'concurrency' ? (
                        <div class="muted small" data-col="in-flight">
                          {tr?.in_flight === undefined ? '—' : num(tr.in_flight)} in flight
                        </div>
                      ) : null}
                    </td>
                    <td class="num" data-col="admitted" data-label="Admitted/s">
                      {tr && t.mode !== 'concurrency' ? num(tr.admitted_per_s) : '—'}
                    </td>
                    <td class={`num${tr && tr.rejected_per_s > 0 ? ' bad-text' : ''}`} data-col="rejected" data-label="Rejected/s">
                      {tr && t.mode !== 'concurrency' ? num(tr.rejected_per_s) : '—'}
                    </td>
                    <td data-label="State">
                      <Badge kind={st.kind} title={st.title}>
                        {st.text}
                      </Badge>
                    </td>
                    <td class="hide-narrow muted" data-col="mode">
                      {t.mode === 'concurrency' ? `lease ${duration(t.lease_ms ?? 10000)}` : sliceLen(t.slice_ms)} · {t.mode}
                    </td>
                  </tr>
                );
              })}
            </tbody>
          </table>
          {tasks.length === 0 ? <p class="muted">No task matches “{q}”.</p> : null}
        </div>
      ) : null}
    </div>
  );
}
