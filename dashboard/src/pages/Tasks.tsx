// Tasks: the task list, a page at a time. The search (a name prefix) and the filters (mode,
// keyed) are the API's (GET /api/v1/tasks?prefix&mode&keyed&limit&after): nothing here loads
// every task. Each page's threshold now, rates and state come from GET /api/v1/traffic with
// the same query, so the traffic read is the page's too.

import { useEffect, useState } from 'preact/hooks';
import {
  ApiError,
  get,
  isNamePrefix,
  MODES,
  taskQueryString,
  type TaskList,
  type TaskQuery,
  type TaskSpec,
  type TaskTraffic,
  type Traffic,
} from '../api';
import { Badge, ErrorNote } from '../components/ui';
import { duration, num, sliceLen } from '../format';
import { Link } from '../router';
import { usePoll } from '../poll';

/** Tasks a page asks for, and how many more "Load more" shows. */
export const PAGE = 100;

/**
 * Requests a load may make beyond its pages when pages come back short: a filter by mode or
 * keyed whose matches are rare (the API examines at most 10,000 specs a request, so ten more
 * cover 100,000).
 */
const EXTRA_REQUESTS = 10;

interface Data {
  tasks: TaskSpec[];
  /** Task name → its traffic (the pages' tasks only). */
  traffic: Record<string, TaskTraffic>;
  trafficError?: ApiError;
  /** The `after` of the page after the last one loaded; null when every match is loaded. */
  next: string | null;
}

/**
 * Walks the pages of `filter` from the first until `want` tasks are loaded or none is left;
 * each page's traffic is read after it (pages without tasks read none).
 */
async function load(filter: TaskQuery, want: number, signal: AbortSignal): Promise<Data> {
  const out: Data = { tasks: [], traffic: {}, next: null };
  let after: string | null = null;
  for (let requests = 1; ; requests++) {
    const qs = taskQueryString({ ...filter, limit: PAGE, after });
    const page = await get<TaskList>(`/api/v1/tasks${qs}`, signal);
    out.tasks.push(...page.tasks);
    if (page.tasks.length > 0 && !out.trafficError) {
      try {
        Object.assign(out.traffic, (await get<Traffic>(`/api/v1/traffic${qs}`, signal)).tasks);
      } catch (e) {
        if (signal.aborted) throw e;
        out.trafficError = e instanceof ApiError ? e : new ApiError(-2, String(e));
      }
    }
    after = page.next ?? null;
    if (!after || out.tasks.length >= want || requests >= Math.ceil(want / PAGE) + EXTRA_REQUESTS) break;
  }
  out.next = after;
  return out;
}

const NOTHING: Data = { tasks: [], traffic: {}, next: null };

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

/** The search and filters, as the page's URL keeps them (`?q=&mode=&keyed=`). */
function fromUrl() {
  const u = new URLSearchParams(location.search);
  const mode = u.get('mode') ?? '';
  const keyed = u.get('keyed') ?? '';
  return {
    q: u.get('q') ?? '',
    mode: (MODES as readonly string[]).includes(mode) ? mode : '',
    keyed: keyed === 'true' || keyed === 'false' ? keyed : '',
  };
}

export function TasksPage() {
  const [initial] = useState(fromUrl);
  const [q, setQ] = useState(initial.q);
  const [mode, setMode] = useState(initial.mode);
  const [keyed, setKeyed] = useState(initial.keyed);
  // The prefix asked for: the search box, once typing pauses.
  const [prefix, setPrefix] = useState(initial.q.trim());
  const [pages, setPages] = useState(1);
  useEffect(() => {
    const t = setTimeout(() => {
      if (q.trim() === prefix) return;
      setPrefix(q.trim());
      setPages(1);
    }, 200);
    return () => clearTimeout(t);
  }, [q]);
  useEffect(() => {
    const u = new URL(location.href);
    for (const [k, v] of [
      ['q', q],
      ['mode', mode],
      ['keyed', keyed],
    ]) {
      if (v) u.searchParams.set(k, v);
      else u.searchParams.delete(k);
    }
    history.replaceState(null, '', u.pathname + u.search);
  }, [q, mode, keyed]);

  const badPrefix = !isNamePrefix(prefix);
  const filter: TaskQuery = { prefix, mode: mode || undefined, keyed: keyed ? keyed === 'true' : undefined };
  const { data, error, loading } = usePoll(
    (s) => (badPrefix ? Promise.resolve(NOTHING) : load(filter, pages * PAGE, s)),
    2000,
    [prefix, mode, keyed, pages],
    { keepData: true },
  );
  const filtered = Boolean(prefix || mode || keyed);
  const tasks = data?.tasks ?? [];
  const what = [
    prefix ? `names starting with “${prefix}”` : '',
    mode ? `mode ${mode}` : '',
    keyed === 'true' ? 'keyed' : keyed === 'false' ? 'not keyed' : '',
  ]
    .filter(Boolean)
    .join(', ');
  const onFilter = (set: (v: string) => void) => (e: Event) => {
    set((e.currentTarget as HTMLSelectElement).value);
    setPages(1);
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
          placeholder="Search by name (its start)"
          value={q}
          aria-invalid={badPrefix ? 'true' : undefined}
          onInput={(e) => setQ(e.currentTarget.value)}
        />
        <label for="task-mode" class="sr-only">
          Mode
        </label>
        <select id="task-mode" value={mode} onChange={onFilter(setMode)}>
          <option value="">Any mode</option>
          {MODES.map((m) => (
            <option value={m}>{m}</option>
          ))}
        </select>
        <label for="task-keyed" class="sr-only">
          Keyed
        </label>
        <select id="task-keyed" value={keyed} onChange={onFilter(setKeyed)}>
          <option value="">Keyed or not</option>
          <option value="true">Keyed</option>
          <option value="false">Not keyed</option>
        </select>
        <span class="muted small" aria-live="polite" data-testid="tasks-count">
          {data && !badPrefix
            ? `${num(tasks.length)} task${tasks.length === 1 ? '' : 's'}${data.next ? ' shown, more to load' : ''}`
            : ''}
        </span>
      </div>
      {badPrefix ? (
        <p class="note" role="alert">
          No task name starts with “{prefix}”: names use only A–Z a–z 0–9 _ . - (at most 64).
        </p>
      ) : null}
      <ErrorNote error={error} what="the tasks" />
      {data?.trafficError && !data.trafficError.unreachable ? (
        <p class="note muted">Live traffic is not available: {data.trafficError.message}</p>
      ) : null}
      {loading && !data ? <p class="muted">Loading…</p> : null}
      {data && tasks.length === 0 && !filtered && !data.next ? (
        <div class="empty">
          <p>No tasks yet.</p>
          <Link href="/new" class="button">
            Create the first task
          </Link>
        </div>
      ) : null}
      {data && tasks.length === 0 && filtered && !badPrefix ? (
        <p class="muted">
          No task matches ({what}){data.next ? ' among those read so far' : ''}.
        </p>
      ) : null}
      {data && tasks.length > 0 ? (
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
                const tr = data.traffic[t.name];
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
        </div>
      ) : null}
      {data?.next && !badPrefix ? (
        <p>
          <button type="button" class="secondary" disabled={loading} onClick={() => setPages((n) => n + 1)}>
            {loading ? 'Loading…' : `Load ${PAGE} more`}
          </button>
        </p>
      ) : null}
    </div>
  );
}
