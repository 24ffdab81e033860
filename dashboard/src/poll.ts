// Polling: run a request now and again `everyMs` after each completes (never overlapping),
// until the component unmounts or its inputs change.

import { useCallback, useEffect, useRef, useState } from 'preact/hooks';
import { ApiError } from './api';

export interface Polled<T> {
  data?: T;
  error?: ApiError;
  /** True until the first answer (data or error). */
  loading: boolean;
  /** Runs the request again now. */
  refresh: () => void;
}

/**
 * `keepData`: when the inputs change, the last data stays on screen until the new request
 * answers (a search box: the list does not blink to "Loading…" at every key).
 */
export function usePoll<T>(
  fn: (signal: AbortSignal) => Promise<T>,
  everyMs: number,
  deps: unknown[],
  { keepData = false }: { keepData?: boolean } = {},
): Polled<T> {
  const [state, setState] = useState<{ data?: T; error?: ApiError; loading: boolean }>({ loading: true });
  const kick = useRef<() => void>(() => {});
  useEffect(() => {
    const ctl = new AbortController();
    let timer: ReturnType<typeof setTimeout> | undefined;
    let running = false;
    setState((s) => (keepData ? { data: s.data, loading: true } : { loading: true }));
    const run = async () => {
      if (running || ctl.signal.aborted) return;
      running = true;
      clearTimeout(timer);
      try {
        const data = await fn(ctl.signal);
        if (!ctl.signal.aborted) setState({ data, loading: false });
      } catch (e) {
        if (ctl.signal.aborted) return;
        const err = e instanceof ApiError ? e : new ApiError(-2, String(e));
        // Keep the last data on screen; the error is shown beside it.
        setState((s) => ({ data: s.data, error: err, loading: false }));
      } finally {
        running = false;
        if (!ctl.signal.aborted && everyMs > 0) {
          // Hidden tabs poll slowly.
          timer = setTimeout(run, document.hidden ? Math.max(everyMs, 10000) : everyMs);
        }
      }
    };
    kick.current = () => void run();
    void run();
    return () => {
      ctl.abort();
      clearTimeout(timer);
    };
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, deps);
  const refresh = useCallback(() => kick.current(), []);
  return { ...state, refresh };
}
