// Number and time formatting for people.

const nf = new Intl.NumberFormat('en-US', { maximumFractionDigits: 1 });
const nf2 = new Intl.NumberFormat('en-US', { maximumFractionDigits: 2 });

export function num(n: number | null | undefined): string {
  if (n === null || n === undefined || Number.isNaN(n)) return '—';
  return nf.format(n);
}

export function num2(n: number | null | undefined): string {
  if (n === null || n === undefined || Number.isNaN(n)) return '—';
  return nf2.format(n);
}

/** 1234 → "1.2 s", 90000 → "1 min 30 s". */
export function duration(ms: number | null | undefined): string {
  if (ms === null || ms === undefined || Number.isNaN(ms)) return '—';
  const neg = ms < 0;
  let a = Math.abs(ms);
  let out: string;
  if (a < 1000) out = `${Math.round(a)} ms`;
  else if (a < 60_000) out = `${nf.format(a / 1000)} s`;
  else if (a < 3_600_000) {
    const m = Math.floor(a / 60_000);
    const s = Math.round((a - m * 60_000) / 1000);
    out = s ? `${m} min ${s} s` : `${m} min`;
  } else if (a < 86_400_000) {
    const h = Math.floor(a / 3_600_000);
    a -= h * 3_600_000;
    const m = Math.round(a / 60_000);
    out = m ? `${h} h ${m} min` : `${h} h`;
  } else {
    const d = Math.floor(a / 86_400_000);
    const h = Math.round((a - d * 86_400_000) / 3_600_000);
    out = h ? `${d} d ${h} h` : `${d} d`;
  }
  return neg ? `−${out}` : out;
}

export function ago(ms: number | null | undefined): string {
  if (ms === null || ms === undefined) return '—';
  return ms < 1500 ? 'just now' : `${duration(ms)} ago`;
}

export function clock(ms: number | null | undefined): string {
  if (!ms) return '—';
  return new Date(ms).toLocaleTimeString();
}

export function dateTime(ms: number | null | undefined): string {
  if (!ms) return '—';
  const d = new Date(ms);
  return `${d.toLocaleDateString()} ${d.toLocaleTimeString()}`;
}

/** Slice length in words: 1000 → "1 s", 100 → "100 ms". */
export function sliceLen(ms: number): string {
  return duration(ms);
}
