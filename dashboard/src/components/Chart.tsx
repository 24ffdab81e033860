// A uPlot time-series chart that fills its container's width and follows its resizes.

import { useEffect, useRef } from 'preact/hooks';
import uPlot from 'uplot';
import 'uplot/dist/uPlot.min.css';

export interface SeriesDef {
  label: string;
  stroke: string;
  fill?: string;
  dash?: number[];
  width?: number;
}

interface Props {
  /** Columns: x in Unix seconds, then one column per series (null = no data). */
  data: (number | null)[][];
  series: SeriesDef[];
  height?: number;
  yLabel?: string;
  /** Text for screen readers (the canvas itself says nothing). */
  label: string;
  testId?: string;
  /** Extra attributes for tests and tooling (e.g. totals). */
  attrs?: Record<string, string | number>;
  /** Fixed x range in Unix seconds (default: the data's). */
  xRange?: [number, number];
}

const fmtY = (v: number) =>
  Math.abs(v) >= 1e6 ? `${(v / 1e6).toFixed(1)}M` : Math.abs(v) >= 1e4 ? `${(v / 1e3).toFixed(0)}k` : `${+v.toFixed(2)}`;

/** A CSS custom property's value (canvas drawing cannot use `var(--x)`). */
function cssVar(name: string, fallback: string): string {
  const v = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return v || fallback;
}

/** Shows the newest values in the legend while the pointer is not on the chart. */
function showLatest(u: uPlot) {
  const n = u.data[0]?.length ?? 0;
  if (n > 0 && (u.cursor.left === undefined || u.cursor.left < 0)) u.setLegend({ idx: n - 1 }, false);
}

export function Chart({ data, series, height = 240, yLabel, label, testId, attrs, xRange }: Props) {
  const box = useRef<HTMLDivElement>(null);
  const plot = useRef<uPlot | null>(null);
  const range = useRef(xRange);
  range.current = xRange;
  const key = series.map((s) => s.label).join('|');

  useEffect(() => {
    const el = box.current;
    if (!el) return;
    const muted = cssVar('--muted', '#5b6776');
    const grid = 'rgba(127,127,127,0.18)';
    const opts: uPlot.Options = {
      width: Math.max(200, el.clientWidth),
      height,
      cursor: { drag: { x: false, y: false } },
      legend: { live: true },
      scales: {
        x: { time: true, range: (_u, min, max) => range.current ?? [min, max] },
        y: { range: (_u, _min, max) => [0, max > 0 ? max * 1.1 : 1] },
      },
      axes: [
        { stroke: muted, grid: { stroke: grid }, ticks: { stroke: grid } },
        {
          label: yLabel,
          stroke: muted,
          size: 60,
          values: (_u, splits) => splits.map(fmtY),
          grid: { stroke: grid },
          ticks: { stroke: grid },
        },
      ],
      hooks: { setCursor: [showLatest] },
      series: [
        { label: 'time' },
        ...series.map((s) => ({
          label: s.label,
          stroke: s.stroke,
          fill: s.fill,
          dash: s.dash,
          width: s.width ?? 2,
          spanGaps: false,
          points: { show: false },
          value: (_u: uPlot, v: number | null) => (v === null || v === undefined ? '—' : fmtY(v)),
        })),
      ],
    };
    const u = new uPlot(opts, data as uPlot.AlignedData, el);
    plot.current = u;
    showLatest(u);
    const ro = new ResizeObserver(() => {
      const w = Math.max(200, el.clientWidth);
      if (Math.abs(w - u.width) > 1) u.setSize({ width: w, height });
    });
    ro.observe(el);
    return () => {
      ro.disconnect();
      u.destroy();
      plot.current = null;
    };
    // Recreated only when the series or the height change; data goes through setData.
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, [key, height, yLabel]);

  useEffect(() => {
    const u = plot.current;
    if (!u) return;
    u.setData(data as uPlot.AlignedData);
    showLatest(u);
  }, [data]);

  return <div class="chart" ref={box} role="img" aria-label={label} data-testid={testId} {...attrs} />;
}

/** Colours of the three traffic series (shared by every chart and legend). */
/** Shadow mode: rejections that were admitted (added to the traffic series when present). */
export const WOULD_REJECT_SERIES: SeriesDef = { label: 'would-reject/s (shadow)', stroke: '#b36b00', dash: [2, 3] };

export const TRAFFIC_SERIES: SeriesDef[] = [
  { label: 'admitted/s', stroke: '#2e9d5b', fill: 'rgba(46,157,91,0.12)' },
  { label: 'rejected/s', stroke: '#d64545', fill: 'rgba(214,69,69,0.12)' },
  { label: 'threshold/s', stroke: '#236fd1', dash: [6, 4], width: 1.5 },
];
