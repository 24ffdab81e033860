// History records → chart columns of per-second rates.
//
// A record sums the slices that start in its bucket (`slice_count` of them, covering `span_ms`
// together), so its rate is count × 1000 / span_ms: right for 100 ms slices summed into a
// second, for 1 s slices, and for a minute that was only partly harvested. Each record carries
// its OWN slice length: a second that ran before a slice-length change keeps the rate it ran at
// (5,000 admitted in a 1 s slice is 5,000/s even after the task moved to 2 s slices). A record
// from a manager without `span_ms` falls back to the task's slice length now.

import type { History, HistoryEntry } from './api';

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
  /** The highest admitted rate of one point (per second). */
  peakAdmittedPerS: number;
  /** The lowest admitted rate of a point that admitted anything (0 when none did). */
  lowAdmittedPerS: number;
}

/** The slice length (ms) of one record's slices: its own, else the task's now. */
export function recordSliceMs(e: HistoryEntry, h: History): number {
  return e.slice_ms && e.slice_ms > 0 ? e.slice_ms : h.slice_ms;
}

/** Per-second rates of one record (admitted, rejected, threshold, would-reject). */
export function recordRates(e: HistoryEntry, h: History): [number, number, number, number] {
  const len = recordSliceMs(e, h);
  const covered = e.span_ms && e.span_ms > 0 ? e.span_ms : Math.max(1, e.slice_count ?? 1) * len;
  return [
    (e.admitted * 1000) / covered,
    (e.rejected * 1000) / covered,
    e.threshold_per_s ?? (e.threshold * 1000) / len,
    ((e.would_reject ?? 0) * 1000) / covered,
  ];
}

export function toColumns(h: History): Columns {
  const xs: number[] = [];
  const adm: (number | null)[] = [];
  const rej: (number | null)[] = [];
  const thr: (number | null)[] = [];
  const wrej: (number | null)[] = [];
  let wouldReject = 0;
  let admitted = 0;
  let rejected = 0;
  let last: number | null = null;
  let peak = 0;
  let low = Infinity;
  let lastStep = 0;
  const step = (e: HistoryEntry) => Math.max(h.resolution_ms, recordSliceMs(e, h));
  const entries = h.slices
    .filter((e) => e.start_ms + step(e) + FLUSH_LAG_MS <= h.now_ms) // still filling: would dip
    .sort((a, b) => a.start_ms - b.start_ms);
  for (const e of entries) {
    if (last !== null && e.start_ms - last > Math.max(lastStep, step(e)) * 1.5) {
      // A gap (no leader, no slices): break the lines.
      xs.push((last + lastStep) / 1000);
      adm.push(null);
      rej.push(null);
      thr.push(null);
      wrej.push(null);
    }
    const [a, r, t, w] = recordRates(e, h);
    xs.push(e.start_ms / 1000);
    adm.push(a);
    rej.push(r);
    thr.push(t);
    wrej.push(w);
    peak = Math.max(peak, a);
    if (e.admitted > 0) low = Math.min(low, a);
    lastStep = step(e);
    wouldReject += e.would_reject ?? 0;
    admitted += e.admitted;
    rejected += e.rejected;
    last = e.start_ms;
  }
  const data = wouldReject > 0 ? [xs, adm, rej, thr, wrej] : [xs, adm, rej, thr];
  return { data, admitted, rejected, wouldReject, points: entries.length, peakAdmittedPerS: peak, lowAdmittedPerS: low === Infinity ? 0 : low };
}
