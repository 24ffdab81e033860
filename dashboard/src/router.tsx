// Client-side routing on the History API. The manager answers every non-API path with
// index.html, so deep links (/tasks/checkout) work on any replica.

import type { AnchorHTMLAttributes, ComponentChildren } from 'preact';
import { createStore, useStore } from './store';

const path = createStore(location.pathname);

window.addEventListener('popstate', () => path.set(location.pathname));

export function navigate(to: string, replace = false) {
  if (to === location.pathname + location.search) return;
  if (replace) history.replaceState(null, '', to);
  else history.pushState(null, '', to);
  path.set(location.pathname);
  window.scrollTo(0, 0);
}

export function usePath(): string {
  return useStore(path);
}

type AnchorProps = AnchorHTMLAttributes<HTMLAnchorElement> & { href: string; children?: ComponentChildren };

/** An <a> that navigates without a page load (modifier clicks still open new tabs). */
export function Link(props: AnchorProps) {
  const { href, children, ...rest } = props;
  const onClick = (e: MouseEvent) => {
    if (e.defaultPrevented || e.button !== 0 || e.metaKey || e.ctrlKey || e.shiftKey || e.altKey) return;
    e.preventDefault();
    navigate(href);
  };
  return (
    <a href={href} onClick={onClick} {...rest}>
      {children}
    </a>
  );
}
