// Alerts: the live feed (clock skew and others) and the webhook settings.

import { useEffect, useLayoutEffect, useRef, useState } from 'preact/hooks';
import { api, ApiError, get, getProtected, type Alert, type Settings } from '../api';
import { fieldId } from '../components/TaskForm';
import { Badge, ErrorNote, NotAvailable, Section } from '../components/ui';
import { dateTime } from '../format';
import { Link } from '../router';
import { usePoll } from '../poll';

function Feed() {
  const { data, error } = usePoll((s) => get<{ alerts: Alert[] }>('/api/v1/alerts', s), 2000, []);
  const seen = useRef<Set<string> | null>(null);
  const [fresh, setFresh] = useState<Set<string>>(new Set());
  useEffect(() => {
    if (!data) return;
    const ids = data.alerts.map((a) => a.id);
    if (seen.current === null) {
      seen.current = new Set(ids);
      return;
    }
    const added = ids.filter((id) => !seen.current!.has(id));
    added.forEach((id) => seen.current!.add(id));
    if (added.length) setFresh(new Set(added));
  }, [data]);

  if (error?.missingEndpoint) return <NotAvailable>Alerts are not available on this manager yet.</NotAvailable>;
  const alerts = [...(data?.alerts ?? [])].sort((a, b) => b.at_ms - a.at_ms);
  return (
    <>
      <ErrorNote error={error} what="the alerts" />
      <p class="sr-only" aria-live="polite">
        {fresh.size ? `${fresh.size} new alert${fresh.size === 1 ? '' : 's'}` : ''}
      </p>
      {data && alerts.length === 0 ? <p class="muted">No alerts. Clock skew and other problems show up here as they happen.</p> : null}
      {alerts.length > 0 ? (
        <ol class="feed" data-testid="alert-feed">
          {alerts.map((a) => (
            <li key={a.id} class={fresh.has(a.id) ? 'fresh' : ''} data-kind={a.kind} data-state={a.state}>
              <div class="feed-head">
                <span>
                  <Badge kind={a.state === 'resolved' ? 'ok' : a.kind === 'clock_skew' ? 'warn' : 'muted'}>
                    {a.kind.replace(/_/g, ' ')}
                  </Badge>{' '}
                  {a.state ? <span class={a.state === 'resolved' ? 'ok-text' : 'bad-text'}>{a.state}</span> : null}
                </span>
                <time dateTime={new Date(a.at_ms).toISOString()}>{dateTime(a.at_ms)}</time>
              </div>
              <div class="feed-msg">{a.message}</div>
              <div class="muted small">
                {a.task ? (
                  <>
                    task <Link href={`/tasks/${encodeURIComponent(a.task)}`}>{a.task}</Link>
                  </>
                ) : null}
                {a.task && a.host ? ' · ' : null}
                {a.host ? `host ${a.host}` : null}
              </div>
            </li>
          ))}
        </ol>
      ) : null}
    </>
  );
}

function SettingsForm() {
  const loaded = usePoll((s) => getProtected<Settings>('/api/v1/settings', s), 0, []);
  const [hooks, setHooks] = useState<string[] | null>(null);
  const [skew, setSkew] = useState('');
  const [quiet, setQuiet] = useState('');
  const [version, setVersion] = useState<number | undefined>(undefined);
  const [error, setError] = useState<ApiError | null>(null);
  const [saving, setSaving] = useState(false);
  const [saved, setSaved] = useState<string | null>(null);

  useEffect(() => {
    if (loaded.data && hooks === null) {
      setHooks([...(loaded.data.webhooks ?? [])]);
      setSkew(String(loaded.data.skew_threshold_ms ?? ''));
      setQuiet(loaded.data.alert_quiet_ms === undefined ? '' : String(loaded.data.alert_quiet_ms));
      setVersion(loaded.data.version);
    }
  }, [loaded.data]);

  // Before the paint, as the task form does: the message and its focused field together.
  useLayoutEffect(() => {
    if (error?.field) document.getElementById(fieldId(error.field))?.focus();
  }, [error]);

  if (loaded.error?.missingEndpoint) {
    return <NotAvailable>Alert settings are not available on this manager yet.</NotAvailable>;
  }
  if (loaded.error) return <ErrorNote error={loaded.error} what="the settings" />;
  if (hooks === null) return <p class="muted">Loading…</p>;

  const errFor = (f: string) => (error?.status === 400 && error.field === f ? error.message : null);
  const submit = async (e: Event) => {
    e.preventDefault();
    setSaving(true);
    setError(null);
    setSaved(null);
    const numOrText = (v: string) => {
      const t = v.trim();
      return t === '' ? undefined : /^\d+(\.\d+)?$/.test(t) ? Number(t) : t;
    };
    const body = {
      ...loaded.data,
      webhooks: hooks.map((h) => h.trim()).filter((h) => h !== ''),
      skew_threshold_ms: numOrText(skew),
      alert_quiet_ms: loaded.data && 'alert_quiet_ms' in loaded.data ? numOrText(quiet) : undefined,
      version,
    };
    try {
      const out = await api<Settings>('PUT', '/api/v1/settings', body);
      if (out && Array.isArray(out.webhooks)) {
        setHooks([...out.webhooks]);
        setSkew(String(out.skew_threshold_ms ?? skew));
        if (out.alert_quiet_ms !== undefined) setQuiet(String(out.alert_quiet_ms));
        setVersion(out.version);
      }
      setSaved('Settings saved.');
    } catch (err) {
      if (err instanceof ApiError) setError(err);
    } finally {
      setSaving(false);
    }
  };
  const skewErr = errFor('skew_threshold_ms');
  const quietErr = errFor('alert_quiet_ms');
  const placed =
    error?.field &&
    (error.field === 'skew_threshold_ms' || error.field === 'alert_quiet_ms' || /^webhooks(\[\d+\])?$/.test(error.field));
  return (
    <form onSubmit={submit} noValidate aria-label="Alert settings" class="settings-form">
      {error && !placed ? (
        <p class="note error" role="alert">
          {error.field ? `${error.field}: ` : ''}
          {error.message}
        </p>
      ) : null}
      <div class={`field${skewErr ? ' has-error' : ''}`}>
        <label for={fieldId('skew_threshold_ms')}>Clock skew threshold (ms)</label>
        <input
          id={fieldId('skew_threshold_ms')}
          type="text"
          inputMode="numeric"
          value={skew}
          aria-invalid={skewErr ? 'true' : undefined}
          aria-describedby={skewErr ? `${fieldId('skew_threshold_ms')}-error` : `${fieldId('skew_threshold_ms')}-hint`}
          onInput={(e) => setSkew(e.currentTarget.value)}
        />
        <p class="hint" id={`${fieldId('skew_threshold_ms')}-hint`}>
          A host whose clock is further than this from Redis time raises a clock_skew alert.
        </p>
        {skewErr ? (
          <p class="field-error" id={`${fieldId('skew_threshold_ms')}-error`} data-testid="field-error">
            {skewErr}
          </p>
        ) : null}
      </div>
      {loaded.data && 'alert_quiet_ms' in loaded.data ? (
        <div class={`field${quietErr ? ' has-error' : ''}`}>
          <label for={fieldId('alert_quiet_ms')}>Resolve after quiet (ms)</label>
          <input
            id={fieldId('alert_quiet_ms')}
            type="text"
            inputMode="numeric"
            value={quiet}
            aria-invalid={quietErr ? 'true' : undefined}
            aria-describedby={quietErr ? `${fieldId('alert_quiet_ms')}-error` : `${fieldId('alert_quiet_ms')}-hint`}
            onInput={(e) => setQuiet(e.currentTarget.value)}
          />
          <p class="hint" id={`${fieldId('alert_quiet_ms')}-hint`}>
            An alert is resolved after this long without a new trigger.
          </p>
          {quietErr ? (
            <p class="field-error" id={`${fieldId('alert_quiet_ms')}-error`} data-testid="field-error">
              {quietErr}
            </p>
          ) : null}
        </div>
      ) : null}
      <fieldset id={`${fieldId('webhooks')}`} tabIndex={-1}>
        <legend>Webhooks</legend>
        <p class="hint">
          Every alert is POSTed as JSON to each URL. Saved URLs are shown shortened (<code>https://host/…</code>: the
          rest is the secret); leave one as it is to keep it, or replace it with a full URL.
        </p>
        {errFor('webhooks') ? (
          <p class="field-error" data-testid="field-error">
            {errFor('webhooks')}
          </p>
        ) : null}
        {hooks.length === 0 ? <p class="muted small">No webhooks.</p> : null}
        {hooks.map((h, i) => {
          const f = `webhooks[${i}]`;
          const msg = errFor(f);
          return (
            <div class={`field inline${msg ? ' has-error' : ''}`} key={i}>
              <label for={fieldId(f)}>Webhook {i + 1}</label>
              <div class="row">
                <input
                  id={fieldId(f)}
                  type="url"
                  placeholder="https://hooks.example.com/sluice"
                  value={h}
                  aria-invalid={msg ? 'true' : undefined}
                  aria-describedby={msg ? `${fieldId(f)}-error` : undefined}
                  onInput={(e) => {
                    const v = e.currentTarget.value;
                    setHooks((old) => (old ?? []).map((x, j) => (j === i ? v : x)));
                  }}
                />
                <button
                  type="button"
                  class="secondary small"
                  aria-label={`Remove webhook ${i + 1}`}
                  onClick={() => setHooks((old) => (old ?? []).filter((_, j) => j !== i))}
                >
                  Remove
                </button>
              </div>
              {msg ? (
                <p class="field-error" id={`${fieldId(f)}-error`} data-testid="field-error">
                  {msg}
                </p>
              ) : null}
            </div>
          );
        })}
        <button
          type="button"
          class="secondary small"
          onClick={() => {
            setHooks((old) => [...(old ?? []), '']);
            setTimeout(() => document.getElementById(fieldId(`webhooks[${hooks.length}]`))?.focus(), 0);
          }}
        >
          Add webhook
        </button>
      </fieldset>
      <div class="actions">
        <button type="submit" disabled={saving}>
          {saving ? 'Saving…' : 'Save settings'}
        </button>
        <span role="status" class="saved">
          {saved}
        </span>
      </div>
    </form>
  );
}

export function AlertsPage() {
  return (
    <div class="page">
      <div class="page-head">
        <h1>Alerts</h1>
      </div>
      <div class="two-col">
        <Section title="Live feed" id="feed">
          <Feed />
        </Section>
        <Section title="Settings" id="alert-settings">
          <SettingsForm />
        </Section>
      </div>
    </div>
  );
}
