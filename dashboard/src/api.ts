// The JSON API client: same origin (any replica serves the API), bounded by timeouts, with
// the connection state the layout shows and the bearer token the manager may ask for.

import { createStore } from './store';

/** A task spec as the API returns it (GET /api/v1/tasks, /api/v1/tasks/{name}). */
export interface TaskSpec {
  name: string;
  version: number;
  threshold: number;
  slice_ms: number;
  pull: number;
  local_limit: number;
  on_failure: string;
  mode: string;
  fallback: { algorithm: string; burst: number };
  /** `timezone`: an IANA zone; absent = UTC. */
  schedules: { cron: string; threshold: number; timezone?: string }[];
  dynamic?: {
    enabled: boolean;
    min: number;
    max: number;
    target_error_rate: number;
    target_latency_ms: number;
  };
  description: string;
  /** Mode `concurrency`: the lease TTL (ms). */
  lease_ms?: number;
  /** Shadow mode: counted as if enforced, everything admitted. */
  shadow?: boolean;
  /** Mode `pooled`: `none` | `smooth` (the quota released evenly over the slice). */
  pacing?: string;
  /** Paced slices: permits released at a slice's start on top of the pace. */
  burst?: number;
  /** Every distinct key has its own limit of `threshold` (mode `pooled`); absent = false. */
  keyed?: boolean;
  /** Keyed tasks: keys with a threshold of their own; absent = none. */
  key_overrides?: Record<string, number>;
}

/** A spec stored in etcd that fails validation (GET /api/v1/tasks lists it under `invalid`). */
export interface InvalidTask {
  name: string;
  version: number;
  error: string;
  field: string;
}

/** A page of tasks (GET /api/v1/tasks): `next` is the `after` of the page after, or null. */
export interface TaskList {
  tasks: TaskSpec[];
  invalid: InvalidTask[];
  next?: string | null;
}

/** What a task list asks for (the query of GET /api/v1/tasks and /api/v1/traffic). */
export interface TaskQuery {
  /** Names starting with this. */
  prefix?: string;
  mode?: string;
  keyed?: boolean;
  limit?: number;
  after?: string | null;
}

/** The modes a spec accepts (the API's spelling). */
export const MODES = ['pooled', 'local', 'exact_fixed', 'exact_sliding', 'concurrency'] as const;

/** Whether `s` can start a task name (`[A-Za-z0-9_.-]`, at most 64; empty = any). */
export const isNamePrefix = (s: string) => /^[A-Za-z0-9_.-]{0,64}$/.test(s);

/** `?prefix=…&mode=…` for a task query (parameters left out when not set). */
export function taskQueryString(q: TaskQuery): string {
  const u = new URLSearchParams();
  if (q.prefix) u.set('prefix', q.prefix);
  if (q.mode) u.set('mode', q.mode);
  if (q.keyed !== undefined) u.set('keyed', String(q.keyed));
  if (q.limit !== undefined) u.set('limit', String(q.limit));
  if (q.after) u.set('after', q.after);
  const s = u.toString();
  return s ? `?${s}` : '';
}

/** One key of a keyed task's top keys, with the permits of the window. */
export interface TopKey {
  key: string;
  permits: number;
}

/** A keyed task's busiest keys (GET /api/v1/tasks/{name}/keys). */
export interface TopKeys {
  task: string;
  keyed: boolean;
  minutes: number;
  window_ms: number;
  overrides: Record<string, number>;
  top_admitted: TopKey[];
  top_rejected: TopKey[];
  malformed_entries?: number;
}

/** One entry of a concurrency task's lease hash, as the task status shows it. */
export interface LeaseHost {
  host: string;
  held: number;
  expires_in_ms: number;
  waiting: number;
  expired: boolean;
}

/** Live status of a task (GET /api/v1/tasks/{name}); mode `concurrency` has lease fields. */
export interface TaskStatus {
  effective_threshold: number | null;
  current_slice_ms?: number;
  remaining?: number | null;
  horizon_until_ms?: number | null;
  /** Left lazy by the leader (`--lazy-after`): slices are made by the first decision of each. */
  lazy?: boolean;
  mode?: string;
  held?: number | null;
  hosts_holding?: number;
  hosts_waiting?: number;
  lease_ms?: number;
  hosts?: LeaseHost[] | null;
  malformed_entries?: number;
  /** The slice before the current one; `would_reject` is the part of `rejected` shadow mode admitted. */
  last_slice?: { start_ms: number; admitted: number; rejected: number; would_reject: number };
  error?: string;
}

/** A host's permits of one concurrency task (its last report). */
export interface PermitReport {
  in_use: number;
  limit: number;
  waiting: number;
  lapses: number;
  reclaimed: number;
}

export interface TaskWithStatus extends TaskSpec {
  status: TaskStatus;
}

export interface ClusterView {
  leader: { node_id: string; addr: string; term: number } | null;
  members: { node_id: string; addr: string; is_leader: boolean; started_ms?: number }[];
  self?: { node_id: string; addr: string };
}

/** One history record (GET /api/v1/tasks/{name}/history). */
export interface HistoryEntry {
  start_ms: number;
  threshold: number;
  admitted: number;
  rejected: number;
  /** Shadow mode: the part of `rejected` that was admitted. */
  would_reject?: number;
  slice_count?: number;
  /** Mean length of the record's own slices (ms), what they were when they ran; null or
   * absent from a manager without it (then the task's slice_ms now is all there is). */
  slice_ms?: number | null;
  /** Time the record's slices cover (ms). */
  span_ms?: number | null;
  admitted_per_s?: number | null;
  rejected_per_s?: number | null;
  would_reject_per_s?: number | null;
  threshold_per_s?: number | null;
}

export interface History {
  resolution_ms: number;
  slice_ms: number;
  now_ms: number;
  from_ms: number;
  live_from_ms: number | null;
  slices: HistoryEntry[];
}

export interface Host {
  host_id: string;
  offset_ms?: number;
  rtt_ms?: number;
  seen_ms?: number;
  sdk?: string;
  tasks?: Record<string, string>;
  permits?: Record<string, PermitReport>;
  age_ms?: number;
  stale?: boolean;
  error?: string;
}

export interface TaskTraffic {
  threshold: number | null;
  admitted_per_s: number;
  rejected_per_s: number;
  /** Shadow mode: rejections per second that were admitted (part of `rejected_per_s`). */
  would_reject_per_s?: number;
  window_ms: number;
  horizon_until_ms?: number | null;
  hosts: Record<string, number>;
  /** Mode `concurrency`: permits held cluster-wide now. */
  in_flight?: number;
  hosts_waiting?: number;
}

export interface Traffic {
  now_ms: number;
  tasks: Record<string, TaskTraffic>;
  /** Asked with `limit`: the `after` of the next page of tasks, or null. */
  next?: string | null;
}

export interface Alert {
  id: string;
  kind: string;
  task?: string | null;
  host?: string | null;
  message: string;
  at_ms: number;
  /** `firing` or `resolved`. */
  state?: string;
  /** The same for the firing and the resolved alert of one incident. */
  episode?: string;
  details?: unknown;
}

export interface Settings {
  webhooks: string[];
  skew_threshold_ms: number;
  alert_quiet_ms?: number;
  version?: number;
  [k: string]: unknown;
}

export interface Adjustment {
  at_ms: number;
  old: number;
  new: number;
  reason: string;
}

/** An API call that failed: HTTP status (0 when the API could not be reached) and message. */
export class ApiError extends Error {
  constructor(
    readonly status: number,
    message: string,
    readonly field?: string,
    readonly body?: unknown,
  ) {
    super(message);
  }

  /** The manager could not be reached at all (network error or timeout). */
  get unreachable(): boolean {
    return this.status === 0;
  }

  /** The endpoint does not exist on this manager (an older or newer version). */
  get missingEndpoint(): boolean {
    return this.status === 404 && /no such API endpoint/i.test(this.message);
  }
}

/** What the layout shows about the API. */
export interface Connection {
  state: 'unknown' | 'ok' | 'unreachable' | 'degraded';
  message?: string;
  since?: number;
}

export const connection = createStore<Connection>({ state: 'unknown' });

function setConnection(c: Connection) {
  const prev = connection.get();
  if (prev.state === c.state && prev.message === c.message) return;
  connection.set({ ...c, since: prev.state === c.state ? prev.since : Date.now() });
}

const TOKEN_KEY = 'sluice.apiToken';

export function getToken(): string | null {
  try {
    return localStorage.getItem(TOKEN_KEY);
  } catch {
    return null;
  }
}

export function setToken(token: string | null) {
  try {
    if (token) localStorage.setItem(TOKEN_KEY, token);
    else localStorage.removeItem(TOKEN_KEY);
  } catch {
    // Private mode: the token lives for this page only.
  }
  tokenStore.set(token);
}

export const tokenStore = createStore<string | null>(getToken());

/**
 * Asks the user for the API token (the dialog registers itself here). Resolves to the token,
 * or null when the user cancels.
 */
export const tokenRequest = createStore<{ reason: string; resolve: (t: string | null) => void } | null>(
  null,
);

function askToken(reason: string): Promise<string | null> {
  const pending = tokenRequest.get();
  if (pending) pending.resolve(null);
  return new Promise((resolve) => {
    tokenRequest.set({
      reason,
      resolve: (t) => {
        tokenRequest.set(null);
        resolve(t);
      },
    });
  });
}

const GET_TIMEOUT_MS = 5000;
const WRITE_TIMEOUT_MS = 10000;

async function once(method: string, path: string, body: unknown, signal?: AbortSignal): Promise<Response> {
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), method === 'GET' ? GET_TIMEOUT_MS : WRITE_TIMEOUT_MS);
  const onAbort = () => ctl.abort();
  signal?.addEventListener('abort', onAbort);
  const headers: Record<string, string> = { Accept: 'application/json' };
  // Every change is JSON (the manager answers 415 otherwise), even one without a body.
  if (body !== undefined || method !== 'GET') headers['Content-Type'] = 'application/json';
  const token = tokenStore.get();
  if (token) headers.Authorization = `Bearer ${token}`;
  try {
    return await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal: ctl.signal,
      cache: 'no-store',
    });
  } catch (e) {
    if (signal?.aborted) throw new ApiError(-1, 'cancelled');
    const msg = ctl.signal.aborted ? 'the request timed out' : 'the network request failed';
    setConnection({ state: 'unreachable', message: msg });
    throw new ApiError(0, `Cannot reach the Sluice API (${msg}).`);
  } finally {
    clearTimeout(timer);
    signal?.removeEventListener('abort', onAbort);
  }
}

/**
 * Calls the API; returns the parsed JSON body (undefined for 204). A change refused with 401
 * asks for the token and is retried once; so is a read with `askOnRead` (the settings: with
 * --api-token they need a token to be read).
 */
export async function api<T>(
  method: string,
  path: string,
  body?: unknown,
  signal?: AbortSignal,
  askOnRead = false,
): Promise<T> {
  let res = await once(method, path, body, signal);
  if (res.status === 401 && (method !== 'GET' || askOnRead)) {
    const what = method === 'GET' ? 'to read this page' : 'for changes';
    const token = await askToken(
      tokenStore.get()
        ? `The manager refused the token. Enter the correct API token ${what}.`
        : `This manager requires an API token ${what} (it runs with --api-token).`,
    );
    if (token) {
      setToken(token);
      res = await once(method, path, body, signal);
    }
  }
  const text = await res.text();
  let json: unknown = undefined;
  if (text) {
    try {
      json = JSON.parse(text);
    } catch {
      json = undefined;
    }
  }
  const err = (json as { error?: string; field?: string } | undefined) ?? {};
  if (res.status === 503) {
    setConnection({ state: 'degraded', message: err.error ?? 'the manager reports a backend outage' });
  } else if (res.status < 500) {
    setConnection({ state: 'ok' });
  }
  if (!res.ok) {
    const message =
      err.error ??
      (res.status === 401 ? 'An API token is required for this change.' : `HTTP ${res.status} ${res.statusText}`);
    throw new ApiError(res.status, message, err.field, json);
  }
  return json as T;
}

export const get = <T>(path: string, signal?: AbortSignal) => api<T>('GET', path, undefined, signal);

/** A read that needs the token when the manager has one (the settings): asks for it on 401. */
export const getProtected = <T>(path: string, signal?: AbortSignal) =>
  api<T>('GET', path, undefined, signal, true);

export const taskPath = (name: string) => `/api/v1/tasks/${encodeURIComponent(name)}`;
