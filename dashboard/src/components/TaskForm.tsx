// Create or edit a task. Validation is the API's: the form sends what was typed and shows the
// API's message next to the field it names (`threshold`, `schedules[1].cron`, `dynamic.min`).

import type { ComponentChildren } from 'preact';
import { useEffect, useLayoutEffect, useRef, useState } from 'preact/hooks';
import { api, ApiError, taskPath, type TaskSpec } from '../api';

const MODES = ['pooled', 'local', 'exact_fixed', 'exact_sliding', 'concurrency'];

const MODE_HINTS: Record<string, string> = {
  pooled: 'pooled: hosts pull chunks of each slice',
  local: 'local: each host limits alone',
  exact_fixed: 'exact_fixed: one Redis call per request',
  exact_sliding: 'exact_sliding: one Redis call per request, sliding window',
  concurrency: 'concurrency: at most threshold permits in flight, cluster-wide',
};
const ON_FAILURE = ['local', 'allow', 'deny'];
const PACINGS = ['none', 'smooth'];
const PACING_HINTS: Record<string, string> = {
  none: 'none: a slice\'s whole quota is available from its start',
  smooth: 'smooth: the quota is released evenly over the slice',
};
const ALGORITHMS = ['token_bucket', 'fixed_window', 'sliding_window', 'sliding_log', 'leaky_bucket'];

/** A schedule entry's zone when it names none (the API neither stores nor returns it). */
const DEFAULT_TIMEZONE = 'UTC';

/** IANA zone names the browser knows, for the schedule rows' datalist (the API validates). */
function zoneNames(): string[] {
  let names: string[] = [];
  try {
    names = Intl.supportedValuesOf('timeZone');
  } catch {
    // An old browser: the field is free text all the same.
  }
  return [DEFAULT_TIMEZONE, ...names.filter((n) => n !== DEFAULT_TIMEZONE)];
}

interface Model {
  name: string;
  threshold: string;
  slice_ms: string;
  pull: string;
  local_limit: string;
  on_failure: string;
  mode: string;
  algorithm: string;
  burst: string;
  description: string;
  schedules: { cron: string; threshold: string; timezone: string }[];
  dynEnabled: boolean;
  dynMin: string;
  dynMax: string;
  dynErr: string;
  dynLat: string;
  lease_ms: string;
  shadow: boolean;
  pacing: string;
  paceBurst: string;
  keyed: boolean;
  /** Keyed tasks: rows of key + threshold, in the order shown. */
  overrides: { key: string; threshold: string }[];
}

function fromSpec(s?: TaskSpec): Model {
  const str = (n: number | undefined) => (n === undefined || n === null ? '' : String(n));
  return {
    name: s?.name ?? '',
    threshold: str(s?.threshold),
    slice_ms: s ? str(s.slice_ms) : '1000',
    pull: s ? str(s.pull) : '',
    local_limit: s ? str(s.local_limit) : '',
    on_failure: s?.on_failure ?? 'local',
    mode: s?.mode ?? 'pooled',
    algorithm: s?.fallback?.algorithm ?? 'token_bucket',
    burst: s ? str(s.fallback?.burst) : '',
    description: s?.description ?? '',
    schedules: (s?.schedules ?? []).map((e) => ({
      cron: e.cron,
      threshold: String(e.threshold),
      timezone: e.timezone ?? DEFAULT_TIMEZONE,
    })),
    dynEnabled: s?.dynamic?.enabled ?? false,
    dynMin: str(s?.dynamic?.min),
    dynMax: str(s?.dynamic?.max),
    dynErr: str(s?.dynamic?.target_error_rate),
    dynLat: str(s?.dynamic?.target_latency_ms),
    lease_ms: str(s?.lease_ms),
    shadow: s?.shadow ?? false,
    pacing: s?.pacing ?? 'none',
    paceBurst: s?.burst ? String(s.burst) : '',
    keyed: s?.keyed ?? false,
    overrides: Object.entries(s?.key_overrides ?? {}).map(([key, t]) => ({ key, threshold: String(t) })),
  };
}

/** The API's field of a key override: `key_overrides["<key>"]` (the key as a JSON string). */
export const overrideField = (key: string) => `key_overrides[${JSON.stringify(key)}]`;

/** The first row (index) whose key appears in an earlier row, or -1. */
function duplicateOverride(rows: { key: string }[]): number {
  const seen = new Set<string>();
  for (let i = 0; i < rows.length; i++) {
    if (seen.has(rows[i].key)) return i;
    seen.add(rows[i].key);
  }
  return -1;
}

/** A typed number, or the raw text (so the API names what is wrong with it), or nothing. */
function numOrText(s: string): number | string | undefined {
  const t = s.trim();
  if (t === '') return undefined;
  return /^-?\d+(\.\d+)?([eE][+-]?\d+)?$/.test(t) ? Number(t) : t;
}

function toBody(m: Model, version: number) {
  const dynTouched = m.dynEnabled || [m.dynMin, m.dynMax, m.dynErr, m.dynLat].some((v) => v.trim() !== '');
  return {
    threshold: numOrText(m.threshold),
    slice_ms: numOrText(m.slice_ms),
    pull: numOrText(m.pull),
    local_limit: numOrText(m.local_limit),
    on_failure: m.on_failure,
    mode: m.mode,
    // Only for mode concurrency (the API refuses it for the others, naming `lease_ms`).
    lease_ms: m.mode === 'concurrency' ? numOrText(m.lease_ms) : undefined,
    fallback: { algorithm: m.algorithm, burst: numOrText(m.burst) },
    schedules: m.schedules.map((s) => ({
      cron: s.cron,
      threshold: numOrText(s.threshold),
      // Empty = the API's default, UTC.
      timezone: s.timezone.trim() === '' ? undefined : s.timezone,
    })),
    dynamic: dynTouched
      ? {
          enabled: m.dynEnabled,
          min: numOrText(m.dynMin),
          max: numOrText(m.dynMax),
          target_error_rate: numOrText(m.dynErr),
          target_latency_ms: numOrText(m.dynLat),
        }
      : undefined,
    description: m.description,
    shadow: m.shadow,
    // Only mode pooled has slices to pace (the API names `pacing` for another mode).
    pacing: m.mode === 'pooled' || m.pacing !== 'none' ? m.pacing : undefined,
    burst: m.pacing === 'smooth' ? numOrText(m.paceBurst) : undefined,
    // Sent whenever set, so the API names `keyed` / `key_overrides` when they do not apply.
    keyed: m.keyed ? true : undefined,
    key_overrides:
      m.overrides.length > 0 ? Object.fromEntries(m.overrides.map((o) => [o.key, numOrText(o.threshold) ?? ''])) : undefined,
    version,
  };
}

/** The element id of an API field path: `schedules[1].cron` → `f-schedules-1-cron`. */
export const fieldId = (field: string) => `f-${field.replace(/[^A-Za-z0-9_]+/g, '-').replace(/-+$/, '')}`;

const KNOWN_GROUPS = ['schedules', 'fallback', 'dynamic', 'keyed', 'key_overrides'];

interface Props {
  /** The task being edited; absent to create one. */
  spec?: TaskSpec;
  onSaved: (spec: TaskSpec, created: boolean) => void;
  /** Asks the parent to load the latest version (after a 409). */
  onReload?: () => void;
}

export function TaskForm({ spec, onSaved, onReload }: Props) {
  const editing = !!spec;
  const [m, setM] = useState<Model>(() => fromSpec(spec));
  const [base, setBase] = useState<number>(spec?.version ?? 0);
  const [dirty, setDirty] = useState(false);
  const [error, setError] = useState<ApiError | null>(null);
  const [saving, setSaving] = useState(false);
  const [saved, setSaved] = useState<string | null>(null);
  const formRef = useRef<HTMLFormElement>(null);

  // A newer version arrived (saved here or elsewhere): follow it unless the user is editing.
  useEffect(() => {
    if (spec && spec.version !== base && !dirty) {
      setM(fromSpec(spec));
      setBase(spec.version);
    }
  }, [spec?.version]);

  const set = <K extends keyof Model>(k: K, v: Model[K]) => {
    setM((old) => ({ ...old, [k]: v }));
    setDirty(true);
    setSaved(null);
  };
  const setSchedule = (i: number, k: 'cron' | 'threshold' | 'timezone', v: string) => {
    setM((old) => ({ ...old, schedules: old.schedules.map((s, j) => (j === i ? { ...s, [k]: v } : s)) }));
    setDirty(true);
    setSaved(null);
  };

  const setOverride = (i: number, k: 'key' | 'threshold', v: string) => {
    setM((old) => ({ ...old, overrides: old.overrides.map((o, j) => (j === i ? { ...o, [k]: v } : o)) }));
    setDirty(true);
    setSaved(null);
  };

  const fieldErr = error && error.status === 400 && error.field !== undefined ? error.field : null;
  const errFor = (field: string) => (fieldErr === field ? error!.message : null);
  // A key override's error names the key (`key_overrides["k"]`); its row shows it (the rows'
  // ids are by index, since a key may be any text).
  const overrideRow = fieldErr === null ? -1 : m.overrides.findIndex((o) => overrideField(o.key) === fieldErr);
  const placed =
    fieldErr !== null &&
    (formRef.current?.querySelector(`#${CSS.escape(fieldId(fieldErr))}`) !== null ||
      KNOWN_GROUPS.includes(fieldErr) ||
      overrideRow >= 0);

  // Before the browser paints the error: whoever sees the message finds its field focused
  // (with useEffect the focus came a frame later, and the e2e test's check raced it).
  useLayoutEffect(() => {
    if (fieldErr === null) return;
    const el =
      (overrideRow >= 0 ? document.getElementById(fieldId(`key_overrides[${overrideRow}].threshold`)) : null) ??
      document.getElementById(fieldId(fieldErr)) ??
      document.getElementById(`${fieldId(fieldErr)}-group`);
    el?.focus();
  }, [error]);

  const submit = async (e: Event) => {
    e.preventDefault();
    if (saving) return;
    const name = editing ? spec!.name : m.name.trim();
    if (!name) {
      setError(new ApiError(400, 'A task needs a name: 1–64 of A–Z a–z 0–9 _ . -', 'name'));
      return;
    }
    // Two rows with one key would collapse into one JSON member: refused here, on the row.
    const dup = duplicateOverride(m.overrides);
    if (dup >= 0) {
      setError(new ApiError(400, 'two rows have this key: keep one', overrideField(m.overrides[dup].key)));
      return;
    }
    setSaving(true);
    setError(null);
    setSaved(null);
    try {
      const out = await api<TaskSpec>('PUT', taskPath(name), toBody(m, editing ? base : 0));
      setDirty(false);
      setBase(out.version);
      setM(fromSpec(out));
      setSaved(editing ? `Saved: version ${out.version}.` : `Created “${out.name}”.`);
      onSaved(out, !editing);
    } catch (err) {
      if (err instanceof ApiError && err.status === 409 && !editing) {
        setError(new ApiError(409, `A task named “${name}” already exists.`, 'name'));
      } else if (err instanceof ApiError) {
        setError(err);
      }
    } finally {
      setSaving(false);
    }
  };

  const text = (
    field: string,
    label: string,
    value: string,
    onInput: (v: string) => void,
    opts: { hint?: string; numeric?: boolean; placeholder?: string; required?: boolean; list?: string } = {},
  ) => {
    const id = fieldId(field);
    const msg = errFor(field);
    const describedBy = [msg ? `${id}-error` : '', opts.hint ? `${id}-hint` : ''].filter(Boolean).join(' ') || undefined;
    return (
      <div class={`field${msg ? ' has-error' : ''}`}>
        <label for={id}>
          {label}
          {opts.required ? <span aria-hidden="true"> *</span> : null}
        </label>
        <input
          id={id}
          name={field}
          type="text"
          inputMode={opts.numeric ? 'decimal' : undefined}
          autoComplete="off"
          placeholder={opts.placeholder}
          list={opts.list}
          value={value}
          aria-invalid={msg ? 'true' : undefined}
          aria-describedby={describedBy}
          aria-required={opts.required ? 'true' : undefined}
          onInput={(e) => onInput(e.currentTarget.value)}
        />
        {opts.hint ? (
          <p class="hint" id={`${id}-hint`}>
            {opts.hint}
          </p>
        ) : null}
        {msg ? (
          <p class="field-error" id={`${id}-error`} data-testid="field-error" data-field={field}>
            {msg}
          </p>
        ) : null}
      </div>
    );
  };

  const select = (field: string, label: string, value: string, options: string[], onChange: (v: string) => void, hint?: string) => {
    const id = fieldId(field);
    const msg = errFor(field);
    return (
      <div class={`field${msg ? ' has-error' : ''}`}>
        <label for={id}>{label}</label>
        <select
          id={id}
          name={field}
          value={value}
          aria-invalid={msg ? 'true' : undefined}
          aria-describedby={msg ? `${id}-error` : hint ? `${id}-hint` : undefined}
          onChange={(e) => onChange(e.currentTarget.value)}
        >
          {options.map((o) => (
            <option value={o}>{o}</option>
          ))}
        </select>
        {hint ? (
          <p class="hint" id={`${id}-hint`}>
            {hint}
          </p>
        ) : null}
        {msg ? (
          <p class="field-error" id={`${id}-error`} data-testid="field-error" data-field={field}>
            {msg}
          </p>
        ) : null}
      </div>
    );
  };

  const groupError = (field: string): ComponentChildren => {
    const msg = errFor(field);
    return msg ? (
      <p class="field-error" id={`${fieldId(field)}-error`} data-testid="field-error" data-field={field}>
        {msg}
      </p>
    ) : null;
  };

  // Mode concurrency has no slices, schedules or dynamic limiting: their fields are hidden
  // unless something is set there (the API then names the field it refuses).
  const conc = m.mode === 'concurrency';
  const showSchedules = !conc || m.schedules.length > 0;
  const showDynamic = !conc || m.dynEnabled;
  // Keyed limits are for mode pooled: shown for it, or for another mode while set (the API
  // then names `keyed`).
  const showKeys = m.mode === 'pooled' || m.keyed || m.overrides.length > 0;

  return (
    <form ref={formRef} class="task-form" onSubmit={submit} noValidate aria-label={editing ? 'Edit task' : 'New task'}>
      {error && error.status === 409 && editing ? (
        <div class="note error" role="alert">
          {error.message}{' '}
          {onReload ? (
            <button
              type="button"
              class="secondary small"
              onClick={() => {
                setDirty(false);
                setError(null);
                onReload();
              }}
            >
              Discard my changes and load the latest
            </button>
          ) : null}
        </div>
      ) : null}
      {error && !(error.status === 409 && editing) && (!fieldErr || !placed) ? (
        <p class="note error" role="alert" data-testid="form-error">
          {error.unreachable ? 'The Sluice API cannot be reached; nothing was saved. ' : ''}
          {error.field ? `${error.field}: ` : ''}
          {error.message}
        </p>
      ) : null}

      <fieldset>
        <legend>Limit</legend>
        <div class="grid">
          {editing
            ? null
            : text('name', 'Name', m.name, (v) => set('name', v), {
                hint: '1–64 characters: A–Z a–z 0–9 _ . -',
                placeholder: 'checkout-api',
                required: true,
              })}
          {text('threshold', m.mode === 'concurrency' ? 'Threshold (permits in flight)' : 'Threshold (permits per slice)', m.threshold, (v) => set('threshold', v), {
            numeric: true,
            placeholder: '5000',
            required: true,
          })}
          {conc
            ? null
            : text('slice_ms', 'Slice length (ms)', m.slice_ms, (v) => set('slice_ms', v), {
            numeric: true,
            hint: '100 ms to 1 day',
          })}
          {text('description', 'Description', m.description, (v) => set('description', v), {
            placeholder: 'checkout API',
          })}
        </div>
      </fieldset>

      <fieldset>
        <legend>Behaviour</legend>
        <div class="grid">
          {select('mode', 'Mode', m.mode, MODES, (v) => set('mode', v), MODE_HINTS[m.mode] ?? undefined)}
          {m.mode === 'concurrency'
            ? text('lease_ms', 'Lease TTL (ms)', m.lease_ms, (v) => set('lease_ms', v), {
                numeric: true,
                hint: '500 ms to 10 min; empty = 10 s: how long a dead host keeps its permits',
              })
            : null}
          {select('on_failure', 'When Redis fails', m.on_failure, ON_FAILURE, (v) => set('on_failure', v))}
          {text('local_limit', conc ? 'Local limit (per host)' : 'Local limit (per host per slice)', m.local_limit, (v) => set('local_limit', v), {
            numeric: true,
            hint: 'used while a host is FAILED; empty = threshold',
          })}
          {/* Accepted and not used by mode concurrency (no slices): not shown for it. */}
          {conc ? null : text('pull', 'Pull chunk', m.pull, (v) => set('pull', v), { numeric: true, hint: '0 or empty = automatic' })}
          {conc ? null : select('fallback.algorithm', 'Local algorithm', m.algorithm, ALGORITHMS, (v) => set('algorithm', v))}
          {conc ? null : text('fallback.burst', 'Local burst', m.burst, (v) => set('burst', v), { numeric: true, hint: '0 = local limit' })}
        </div>
        {groupError('fallback')}
      </fieldset>

      <fieldset>
        <legend>Rollout and pacing</legend>
        <div class="field checkbox">
          <input
            id={fieldId('shadow')}
            type="checkbox"
            checked={m.shadow}
            aria-describedby={`${fieldId('shadow')}-hint`}
            onChange={(e) => set('shadow', e.currentTarget.checked)}
          />
          <label for={fieldId('shadow')}>Shadow: count, do not enforce</label>
          <p class="hint" id={`${fieldId('shadow')}-hint`}>
            admit everything, count what the limit would reject (to roll a limit out safely)
          </p>
          {groupError('shadow')}
        </div>
        {m.mode === 'pooled' || m.pacing !== 'none' ? (
          <div class="grid">
            {select('pacing', 'Pacing', m.pacing, PACINGS, (v) => set('pacing', v), PACING_HINTS[m.pacing])}
            {m.pacing === 'smooth'
              ? text('burst', 'Burst (permits)', m.paceBurst, (v) => set('paceBurst', v), {
                  numeric: true,
                  hint: 'released at each slice start on top of the pace; at most the threshold',
                })
              : null}
          </div>
        ) : null}
      </fieldset>
      {showKeys ? (
      <fieldset id={`${fieldId('key_overrides')}-group`} tabIndex={-1} data-testid="keys-fieldset">
        <legend>Keys</legend>
        <div class="field checkbox">
          <input
            id={fieldId('keyed')}
            type="checkbox"
            checked={m.keyed}
            aria-describedby={`${fieldId('keyed')}-hint`}
            onChange={(e) => set('keyed', e.currentTarget.checked)}
          />
          <label for={fieldId('keyed')}>A limit per key</label>
          <p class="hint" id={`${fieldId('keyed')}-hint`}>
            Every distinct key (tenant, user, route…) gets its own threshold per slice; callers name the key.
          </p>
          {groupError('keyed')}
        </div>
        {m.keyed || m.overrides.length > 0 ? (
          <>
            <p class="hint">Overrides: keys with a threshold of their own (any text up to 256 bytes; at most 1,000).</p>
            {groupError('key_overrides')}
            {m.overrides.length === 0 ? <p class="muted small">No overrides: every key gets the threshold.</p> : null}
            {m.overrides.map((o, i) => {
              const rowErr = overrideRow === i ? error!.message : null;
              return (
                <div class={`override-row${rowErr ? ' has-error' : ''}`} key={i} data-testid="override-row">
                  {text(`key_overrides[${i}].key`, `Override ${i + 1} key`, o.key, (v) => setOverride(i, 'key', v), {
                    placeholder: 'tenant-42',
                  })}
                  {text(`key_overrides[${i}].threshold`, `Override ${i + 1} threshold`, o.threshold, (v) => setOverride(i, 'threshold', v), {
                    numeric: true,
                  })}
                  <button
                    type="button"
                    class="secondary small remove"
                    aria-label={`Remove override ${i + 1}`}
                    onClick={() => {
                      setM((old) => ({ ...old, overrides: old.overrides.filter((_, j) => j !== i) }));
                      setDirty(true);
                    }}
                  >
                    Remove
                  </button>
                  {rowErr ? (
                    <p class="field-error override-error" role="alert" data-testid="field-error" data-field={fieldErr ?? undefined}>
                      {rowErr}
                    </p>
                  ) : null}
                </div>
              );
            })}
            <button
              type="button"
              class="secondary small"
              onClick={() => {
                setM((old) => ({ ...old, overrides: [...old.overrides, { key: '', threshold: '' }] }));
                setDirty(true);
                setTimeout(() => document.getElementById(fieldId(`key_overrides[${m.overrides.length}].key`))?.focus(), 0);
              }}
            >
              Add override
            </button>
          </>
        ) : null}
      </fieldset>
      ) : null}

      {showSchedules ? (
      <fieldset id={`${fieldId('schedules')}-group`} tabIndex={-1}>
        <legend>Schedules</legend>
        <p class="hint">
          Cron with seconds, read on the clock of the row's time zone (an IANA name; empty = UTC); slices starting at a
          match get that threshold (later rows win). On daylight-saving days a skipped local time matches nothing and a
          repeated one matches both times.
        </p>
        {m.schedules.length > 0 ? (
          <datalist id="tz-names">
            {zoneNames().map((z) => (
              <option value={z} />
            ))}
          </datalist>
        ) : null}
        {groupError('schedules')}
        {m.schedules.length === 0 ? <p class="muted small">No schedules.</p> : null}
        {m.schedules.map((s, i) => (
          <div class="schedule-row" key={i}>
            {text(`schedules[${i}].cron`, `Schedule ${i + 1} cron`, s.cron, (v) => setSchedule(i, 'cron', v), {
              placeholder: '0 0 9-17 * * Mon-Fri',
            })}
            {text(`schedules[${i}].threshold`, `Schedule ${i + 1} threshold`, s.threshold, (v) => setSchedule(i, 'threshold', v), {
              numeric: true,
            })}
            {text(`schedules[${i}].timezone`, `Schedule ${i + 1} time zone`, s.timezone, (v) => setSchedule(i, 'timezone', v), {
              placeholder: DEFAULT_TIMEZONE,
              list: 'tz-names',
            })}
            <button
              type="button"
              class="secondary small remove"
              aria-label={`Remove schedule ${i + 1}`}
              onClick={() => {
                setM((old) => ({ ...old, schedules: old.schedules.filter((_, j) => j !== i) }));
                setDirty(true);
              }}
            >
              Remove
            </button>
          </div>
        ))}
        <button
          type="button"
          class="secondary small"
          onClick={() => {
            setM((old) => ({ ...old, schedules: [...old.schedules, { cron: '', threshold: '', timezone: DEFAULT_TIMEZONE }] }));
            setDirty(true);
            setTimeout(() => document.getElementById(fieldId(`schedules[${m.schedules.length}].cron`))?.focus(), 0);
          }}
        >
          Add schedule
        </button>
      </fieldset>
      ) : null}

      {showDynamic ? (
      <fieldset id={`${fieldId('dynamic')}-group`} tabIndex={-1}>
        <legend>Dynamic limiting</legend>
        {groupError('dynamic')}
        <div class="field checkbox">
          <input
            id={fieldId('dynamic.enabled')}
            type="checkbox"
            checked={m.dynEnabled}
            onChange={(e) => set('dynEnabled', e.currentTarget.checked)}
          />
          <label for={fieldId('dynamic.enabled')}>Adjust the threshold from the service's health</label>
          {groupError('dynamic.enabled')}
        </div>
        <div class="grid">
          {text('dynamic.min', 'Lowest threshold', m.dynMin, (v) => set('dynMin', v), { numeric: true })}
          {text('dynamic.max', 'Highest threshold', m.dynMax, (v) => set('dynMax', v), { numeric: true })}
          {text('dynamic.target_error_rate', 'Target error rate (0–1)', m.dynErr, (v) => set('dynErr', v), {
            numeric: true,
            placeholder: '0.05',
          })}
          {text('dynamic.target_latency_ms', 'Target latency (ms)', m.dynLat, (v) => set('dynLat', v), {
            numeric: true,
            placeholder: '200',
          })}
        </div>
      </fieldset>
      ) : null}

      <div class="actions">
        <button type="submit" disabled={saving}>
          {saving ? 'Saving…' : editing ? 'Save changes' : 'Create task'}
        </button>
        {dirty && editing ? <span class="muted small">Unsaved changes</span> : null}
        <span role="status" class="saved" data-testid="form-status">
          {saved}
        </span>
      </div>
    </form>
  );
}
