// The frame of every page: navigation, the replica this page talks to, and the API state.

import type { ComponentChildren } from 'preact';
import { useEffect, useState } from 'preact/hooks';
import { connection, get, setToken, tokenStore, type ClusterView } from '../api';
import { duration } from '../format';
import { Link, usePath } from '../router';
import { useStore } from '../store';
import { usePoll } from '../poll';

const NAV = [
  { href: '/', label: 'Tasks', match: (p: string) => p === '/' || p.startsWith('/tasks') || p === '/new' },
  { href: '/cluster', label: 'Cluster', match: (p: string) => p.startsWith('/cluster') },
  { href: '/alerts', label: 'Alerts', match: (p: string) => p.startsWith('/alerts') },
];

function ConnectionBanner() {
  const c = useStore(connection);
  const [, tick] = useState(0);
  useEffect(() => {
    if (c.state === 'ok' || c.state === 'unknown') return;
    const t = setInterval(() => tick((n) => n + 1), 1000);
    return () => clearInterval(t);
  }, [c.state]);
  if (c.state === 'unreachable') {
    return (
      <div class="banner banner-bad" role="alert" data-testid="api-unreachable">
        <strong>The Sluice API at {location.host} cannot be reached</strong> ({c.message}
        {c.since ? `, for ${duration(Date.now() - c.since)}` : ''}). The data shown may be stale; retrying every
        few seconds. Any other manager replica serves the same dashboard.
      </div>
    );
  }
  if (c.state === 'degraded') {
    return (
      <div class="banner banner-warn" role="alert" data-testid="api-degraded">
        <strong>The manager answers but cannot reach its backend:</strong> {c.message}
      </div>
    );
  }
  return null;
}

function Replica() {
  const { data } = usePoll((s) => get<ClusterView>('/api/v1/cluster', s), 5000, []);
  if (!data?.self) return null;
  const isLeader = data.leader?.node_id === data.self.node_id;
  return (
    <span class="replica" title={`This page talks to ${data.self.addr}`}>
      via <strong>{data.self.node_id}</strong>
      {isLeader ? ' (leader)' : ''}
    </span>
  );
}

function TokenButton() {
  const token = useStore(tokenStore);
  if (!token) return null;
  return (
    <button type="button" class="link small" onClick={() => setToken(null)} title="Forget the API token stored in this browser">
      Forget token
    </button>
  );
}

export function Layout({ children }: { children: ComponentChildren }) {
  const path = usePath();
  return (
    <>
      <a class="skip" href="#main">
        Skip to content
      </a>
      <header class="topbar">
        <Link href="/" class="brand" aria-label="Sluice home">
          <span class="logo" aria-hidden="true" />
          Sluice
        </Link>
        <nav aria-label="Main">
          {NAV.map((n) => (
            <Link href={n.href} class={n.match(path) ? 'active' : ''} aria-current={n.match(path) ? 'page' : undefined}>
              {n.label}
            </Link>
          ))}
        </nav>
        <div class="topbar-right">
          <Replica />
          <TokenButton />
        </div>
      </header>
      <ConnectionBanner />
      <main id="main" tabIndex={-1}>
        {children}
      </main>
    </>
  );
}
