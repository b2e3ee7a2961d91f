/**
 * Small DOM helpers: every text goes in as text (textContent), never as HTML.
 */
export const STATUS_ICON: { [status: string]: string } = {
  starting: '○',
  running: '●',
  paused: '‖',
  stopping: '◐',
  finished: '✔',
  failed: '✖',
  'timed out': '⏱',
  cancelled: '■',
  stopped: '■',
  idle: '●',
  broken: '✖',
  closed: '■'
};

export const RANK_COLORS = [
  '#1f77b4',
  '#ff7f0e',
  '#2ca02c',
  '#d62728',
  '#9467bd',
  '#8c564b',
  '#e377c2',
  '#7f7f7f',
  '#bcbd22',
  '#17becf'
];

export function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  attrs: { [name: string]: string } = {},
  text?: string
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    node.setAttribute(name, value);
  }
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

const SVG = 'http://www.w3.org/2000/svg';

export function svg(tag: string, attrs: { [name: string]: string | number } = {}): SVGElement {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) {
    node.setAttribute(name, String(value));
  }
  return node;
}

/** 0:42, 12:03, 1:02:03 */
export function formatElapsed(seconds: number): string {
  const s = Math.max(0, Math.floor(seconds));
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const sec = String(s % 60).padStart(2, '0');
  return h ? `${h}:${String(m).padStart(2, '0')}:${sec}` : `${m}:${sec}`;
}

/** A metric value as the panel shows it: 4 significant digits. */
export function formatValue(value: number | string): string {
  if (typeof value !== 'number') {
    return String(value);
  }
  if (Number.isInteger(value) && Math.abs(value) < 1e6) {
    return String(value);
  }
  return Math.abs(value) >= 1e5 || (value !== 0 && Math.abs(value) < 1e-3) ? value.toExponential(3) : String(Number(value.toPrecision(4)));
}
