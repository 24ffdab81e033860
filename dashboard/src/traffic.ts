// History records → chart columns of per-second rates.
//
// A record sums the slices that start in its bucket (`slice_count` of them), so its rate is
// count × 1000 / (slice_count × slice_ms): right for 100 ms slices summed into a second, for
// 1 s slices, and for a minute that was only partly harvested. The threshold is per slice,
// so its rate is threshold × 1000 / slice_ms.

import type { History } from './api';

/** Workers flush their counts about once a second: the newest buckets are still filling. */
export const FLUSH_LAG_MS = 2000;

export interface Columns {
  /** x, admitted, rejected, threshold, and would-reject when any record has one. */
  data: (number | null)[][];
  admitted: number;
  rejected: number;
  /** Shadow mode: the part of `rejected` that was admitted. */
  wouldReject: number;
  points: number;
}

export function toColumns(h: History): Columns {
  const step = Math.max(h.resolution_ms, h.slice_ms);
  const xs: number[] = [];
  const adm: (number | null)[] = [];
  const rej: (number | null)[] = [];
  const thr: (number | null)[] = [];
  const wrej: (number | null)[] = [];
  let wouldReject = 0;
  let admitted = 0;
  let rejected = 0;
  let last: number | null = null;
  const entries = h.slices
    .filter((e) => e.start_ms + step + FLUSH_LAG_MS <= h.now_ms) // still filling: would dip
    .sort((a, b) => a.start_ms - b.start_ms);
  for (const e of entries) {
    if (last !== null && e.start_ms - last > step * 1.5) {
      // A gap (no leader, no slices): break the lines.
      xs.push((last + step) / 1000);
      adm.push(null);
      rej.push(null);
      thr.push(null);
      wrej.push(null);
    }
    const covered = Math.max(1, e.slice_count ?? 1) * h.slice_ms;
    xs.push(e.start_ms / 1000);
    adm.push((e.admitted * 1000) / covered);
    rej.push((e.rejected * 1000) / covered);
    thr.push((e.threshold * 1000) / h.slice_ms);
    wrej.push(((e.would_reject ?? 0) * 1000) / covered);
    wouldReject += e.would_reject ?? 0;
    admitted += e.admitted;
    rejected += e.rejected;
    last = e.start_ms;
  }
  const data = wouldReject > 0 ? [xs, adm, rej, thr, wrej] : [xs, adm, rej, thr];
  return { data, admitted, rejected, wouldReject, points: entries.length };
}
