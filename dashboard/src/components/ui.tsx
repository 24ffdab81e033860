// Small shared pieces: error notes, state badges, empty states.

import type { ComponentChildren } from 'preact';
import { ApiError } from '../api';

/** An API error in words: unreachable, missing endpoint, or the API's own message. */
export function ErrorNote({ error, what }: { error?: ApiError; what?: string }) {
  if (!error || error.status === -1) return null;
  let text: string;
  if (error.unreachable) text = `${what ? `Could not load ${what}: ` : ''}the Sluice API cannot be reached. Retrying…`;
  else if (error.missingEndpoint) text = `${what ?? 'This feature'} is not available on this manager.`;
  else text = `${what ? `Could not load ${what}: ` : ''}${error.message}`;
  return (
    <p class="note error" role="alert">
      {text}
    </p>
  );
}

/** Shown instead of a section whose endpoint this manager does not have yet. */
export function NotAvailable({ children }: { children: ComponentChildren }) {
  return (
    <p class="note muted" data-testid="not-available">
      {children}
    </p>
  );
}

export function Badge({ kind, children, title }: { kind: string; children: ComponentChildren; title?: string }) {
  return (
    <span class={`badge badge-${kind}`} title={title}>
      {children}
    </span>
  );
}

/** A host's state for a task (`normal` / `limited` / `failed`). */
export function StateBadge({ state }: { state: string }) {
  const kind = state === 'normal' ? 'ok' : state === 'limited' ? 'warn' : state === 'failed' ? 'bad' : 'muted';
  return <Badge kind={kind}>{state}</Badge>;
}

export function Section({
  title,
  id,
  actions,
  children,
}: {
  title: string;
  id?: string;
  actions?: ComponentChildren;
  children: ComponentChildren;
}) {
  const hid = id ? `${id}-title` : undefined;
  return (
    <section class="card" id={id} aria-labelledby={hid}>
      <div class="card-head">
        <h2 id={hid}>{title}</h2>
        {actions ? <div class="card-actions">{actions}</div> : null}
      </div>
      {children}
    </section>
  );
}

export function Stat({ label, value, hint, testId }: { label: string; value: ComponentChildren; hint?: string; testId?: string }) {
  return (
    <div class="stat" data-testid={testId}>
      <div class="stat-label">{label}</div>
      <div class="stat-value">{value}</div>
      {hint ? <div class="stat-hint">{hint}</div> : null}
    </div>
  );
}
