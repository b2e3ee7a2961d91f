/**
 * The renderer of a launch's saved summary (application/vnd.air-magic.summary+json, made
 * by air_magic/panel/_mime.py): per-rank outcome, the metrics charted, the MLflow run, the
 * linter's findings and each rank's last lines.  Drawn from the data with DOM calls (no
 * HTML from the notebook), so it reads the same trusted or not, with or without a kernel.
 * Other front ends show the text/html or text/plain forms of the same display.
 */
import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Widget } from '@lumino/widgets';

import { el, formatValue, RANK_COLORS, STATUS_ICON, svg } from './dom';

export const SUMMARY_MIME = 'application/vnd.air-magic.summary+json';
const VERSION = 1;

interface IRankSummary {
  rank: number;
  state: string;
  returncode: number | null;
  progress: string;
  metrics: { [key: string]: number | string };
  last_line: string;
  log_tail: string[];
  log_path: string;
}

interface ISummary {
  version: number;
  launch: string;
  label: string;
  status: string;
  outcome: string;
  where: string;
  world_size: number;
  elapsed: number;
  ranks: IRankSummary[];
  charts: { [key: string]: { [rank: string]: [number, number][] } };
  tracking: boolean;
  run: { id: string; name: string; url: string; command: string } | null;
  /** "launch", or "pool call" for a call of a pool (air_magic/kernel/pool/view.py). */
  noun?: string;
  /** A pool call's pool, said on a line above the title ('' for a launch). */
  context?: string;
  /** What is still stored of the run after the end ("MLflow: storing 1,234 points…"); '' once stored. */
  storing?: string;
  /** The chart model the kernel's panel draws its SVG from too (air_magic/panel/_svg.py chart_model). */
  chart_models?: { [key: string]: IChartModel };
  lint: { text: string; hint: string; fix: string }[];
  logs: string;
}

interface IChartModel {
  key: string;
  title: string;
  caption: string;
  width: number;
  height: number;
  plot: { left: number; top: number; width: number; height: number };
  labels: { y_top: string; y_bottom: string; x_left: string; x_right: string };
  by_index: boolean;
  lines: { [rank: string]: [number, number][] };
}

export class SummaryRenderer extends Widget implements IRenderMime.IRenderer {
  constructor() {
    super();
    this.addClass('air-magic-Summary');
  }

  renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    const data = model.data[SUMMARY_MIME] as unknown as ISummary;
    this.node.textContent = '';
    if (!data || typeof data !== 'object' || data.version !== VERSION || !Array.isArray(data.ranks)) {
      this.node.appendChild(el('div', {}, 'air_magic: a launch summary of another version.'));
      return Promise.resolve();
    }
    this.node.appendChild(renderSummary(data));
    return Promise.resolve();
  }
}

function renderSummary(data: ISummary): HTMLElement {
  const root = el('div', {
    class: 'air-magic-panel',
    'data-air-magic-status': data.status,
    'data-air-magic-launch': data.launch
  });
  if (data.context) {
    root.appendChild(el('div', { class: 'air-magic-muted', 'data-air-magic-context': '1' }, data.context));
  }
  const title = el('div', { class: 'air-magic-Summary-title' });
  title.appendChild(el('b', {}, data.label));
  title.appendChild(document.createTextNode(` on ${data.where} · `));
  title.appendChild(el('span', { class: `air-magic-status air-magic-status-${data.status.replace(' ', '-')}` },
    `${STATUS_ICON[data.status] ?? '●'} ${data.status}`));
  // How long it took is in the outcome line ("finished in 38.0 s"): said once.
  title.appendChild(document.createTextNode(' · '));
  title.appendChild(el('span', { class: 'air-magic-muted' }, `${data.noun || 'launch'} ${data.launch}`));
  root.appendChild(title);
  if (data.run) {
    const run = el('div', { 'data-air-magic-run': '1' }, 'MLflow run ');
    const name = data.run.name || data.run.id.slice(0, 12);
    if (/^https?:\/\//.test(data.run.url)) {
      run.appendChild(el('a', { href: data.run.url, target: '_blank', rel: 'noopener' }, name));
    } else {
      run.appendChild(el('b', { title: data.run.id }, name));
    }
    if (data.run.id && data.run.name) {
      run.appendChild(el('span', { class: 'air-magic-muted' }, ` (${data.run.id})`));
    }
    if (!data.run.url && data.run.command) {
      run.appendChild(document.createTextNode(' · open it with: '));
      const code = el('code', { class: 'air-magic-command' }, data.run.command);
      run.appendChild(code);
      run.appendChild(copyButton(code, data.run.command));
    }
    root.appendChild(run);
  }
  if (data.storing) {
    root.appendChild(el('div', { class: 'air-magic-muted', 'data-air-magic-storing': '1' }, data.storing));
  }
  root.appendChild(rankTable(data));
  root.appendChild(el('div', { class: `air-magic-outcome air-magic-status-${data.status.replace(' ', '-')}`,
    'data-air-magic-outcome': '1' }, `${STATUS_ICON[data.status] ?? '●'} ${data.outcome}`));
  const keys = Object.keys(data.charts ?? {});
  if (keys.length) {
    const details = el('details', { open: '' });
    details.appendChild(el('summary', {}, 'metrics'));
    const legend = el('div', { class: 'air-magic-legend' });
    for (let r = 0; r < data.world_size && r < 16; r++) {
      const item = el('span', { 'data-air-magic-legend': String(r) });
      const swatch = el('span', { class: 'air-magic-swatch' });
      swatch.style.background = RANK_COLORS[r % RANK_COLORS.length];
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(`rank ${r}`));
      legend.appendChild(item);
    }
    details.appendChild(legend);
    const charts = el('div', { class: 'air-magic-charts', 'data-air-magic-chart': '1' });
    for (const key of keys) {
      const model = data.chart_models?.[key];
      charts.appendChild(model ? modelChart(model) : chart(key, data.charts[key]));
    }
    details.appendChild(charts);
    root.appendChild(details);
  }
  if (data.lint && data.lint.length) {
    const lint = el('div', { 'data-air-magic-lint': '1' }, 'migration linter:');
    const list = el('ul');
    for (const finding of data.lint) {
      const li = el('li', {}, finding.text);
      if (finding.hint) {
        li.appendChild(el('div', { class: 'air-magic-muted' }, `→ ${finding.hint}`));
      }
      list.appendChild(li);
    }
    lint.appendChild(list);
    root.appendChild(lint);
  }
  for (const rank of data.ranks) {
    if (!rank.log_tail.length) { // nothing to open: one quiet line says so
      root.appendChild(el('div', { class: 'air-magic-muted' }, `rank ${rank.rank} printed nothing · full log: ${rank.log_path}`));
      continue;
    }
    const details = el('details');
    details.appendChild(el('summary', {}, `rank ${rank.rank} log (${rank.log_tail.length === 1 ? 'its last line' : `last ${rank.log_tail.length} lines`})`));
    details.appendChild(el('div', { class: 'air-magic-muted' }, `full log: ${rank.log_path}`));
    details.appendChild(el('pre', { class: 'air-magic-log' }, rank.log_tail.length ? rank.log_tail.join('\n') : '(nothing printed)'));
    root.appendChild(details);
  }
  return root;
}

function rankTable(data: ISummary): HTMLElement {
  const table = el('table', { class: 'air-magic-ranks' });
  const colgroup = el('colgroup');
  for (const width of ['4em', '9em', '33%', '14%', '']) {
    const col = el('col');
    if (width) {
      col.style.width = width;
    }
    colgroup.appendChild(col);
  }
  table.appendChild(colgroup);
  const head = el('tr');
  for (const name of ['rank', 'state', 'progress', 'metrics', 'last line']) {
    head.appendChild(el('th', {}, name));
  }
  table.appendChild(el('thead')).appendChild(head);
  const body = el('tbody');
  for (const rank of data.ranks) {
    const row = el('tr', { 'data-rank': String(rank.rank), 'data-state': rank.state });
    row.appendChild(el('td', {}, String(rank.rank)));
    // A stopped rank did not crash: its exit code (the stop's doing) is on hover only, and
    // the KeyboardInterrupt it printed is muted, as in the panel.
    const stopped = rank.state === 'stopped';
    const failedExit = rank.returncode !== null && rank.returncode !== 0;
    const exit = failedExit && !stopped ? ` (exit ${rank.returncode})` : '';
    const shown = stopped ? 'cancelled' : rank.state;
    const state = el('td', { class: `air-magic-status-${shown.replace(' ', '-')}` },
      `${STATUS_ICON[rank.state] ?? '●'} ${rank.state}${exit}`);
    if (stopped && failedExit) {
      state.title = `exit ${rank.returncode}`;
    }
    row.appendChild(state);
    row.appendChild(el('td', {}, rank.progress));
    // One metric a line: the name cut at the column's edge, its value whole (as in the panel).
    const metrics = el('td');
    for (const [key, value] of Object.entries(rank.metrics ?? {}).slice(-3)) {
      const shown = formatValue(value);
      const line = el('div', { class: 'air-magic-metric', 'data-air-magic-metric': key, title: `${key}=${shown}` });
      line.appendChild(el('span', { class: 'air-magic-metric-name' }, key));
      line.appendChild(el('span', {}, `=${shown}`));
      metrics.appendChild(line);
    }
    row.appendChild(metrics);
    const muted = stopped && rank.last_line.startsWith('KeyboardInterrupt') ? ' air-magic-muted' : '';
    row.appendChild(el('td', { class: `air-magic-lastline${muted}`, title: rank.last_line }, rank.last_line));
    body.appendChild(row);
  }
  table.appendChild(body);
  return table;
}

/** One metric: a line per rank (its colour), axes' ends labelled. */
function chart(key: string, lines: { [rank: string]: [number, number][] }): HTMLElement {
  const width = 300;
  const height = 150;
  const pad = { left: 44, right: 8, top: 8, bottom: 20 };
  const all = Object.values(lines).flat();
  const figure = el('figure', { class: 'air-magic-chart', 'data-air-magic-metric': key });
  if (!all.length) {
    return figure;
  }
  let [x0, x1] = [Math.min(...all.map(p => p[0])), Math.max(...all.map(p => p[0]))];
  let [y0, y1] = [Math.min(...all.map(p => p[1])), Math.max(...all.map(p => p[1]))];
  if (x0 === x1) {
    [x0, x1] = [x0 - 1, x1 + 1];
  }
  if (y0 === y1) {
    [y0, y1] = [y0 - 1, y1 + 1];
  }
  const sx = (x: number) => pad.left + ((x - x0) / (x1 - x0)) * (width - pad.left - pad.right);
  const sy = (y: number) => height - pad.bottom - ((y - y0) / (y1 - y0)) * (height - pad.top - pad.bottom);
  const root = svg('svg', { viewBox: `0 0 ${width} ${height}`, width, height, role: 'img' });
  root.appendChild(svg('rect', { x: pad.left, y: pad.top, width: width - pad.left - pad.right,
    height: height - pad.top - pad.bottom, fill: 'none', stroke: 'currentColor', 'stroke-opacity': 0.2 }));
  const label = (x: number, y: number, text: string, anchor: string) => {
    const t = svg('text', { x, y, 'font-size': 10, 'text-anchor': anchor, fill: 'currentColor' });
    t.textContent = text;
    root.appendChild(t);
  };
  label(pad.left - 4, pad.top + 8, formatValue(y1), 'end');
  label(pad.left - 4, height - pad.bottom, formatValue(y0), 'end');
  label(pad.left, height - 6, formatValue(x0), 'start');
  label(width - pad.right, height - 6, formatValue(x1), 'end');
  for (const [rank, points] of Object.entries(lines)) {
    const color = RANK_COLORS[Number(rank) % RANK_COLORS.length];
    const path = points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(' ');
    root.appendChild(svg('polyline', { points: path, fill: 'none', stroke: color, 'stroke-width': 1.5,
      'data-rank': rank }));
  }
  figure.appendChild(root);
  const last = Object.entries(lines).map(([rank, points]) =>
    `rank ${rank} ${formatValue(points[points.length - 1][1])}`).join(' · ');
  figure.appendChild(el('figcaption', {}, `${key}: ${last}`));
  return figure;
}

/** One metric drawn from the kernel's chart model: the same title, margins, labels and
 * points (already scaled) as the panel's SVG, so the three views of a launch agree. */
function modelChart(model: IChartModel): HTMLElement {
  const figure = el('figure', { class: 'air-magic-chart', 'data-air-magic-metric': model.key });
  const { width, height, plot, labels } = model;
  const root = svg('svg', { viewBox: `0 0 ${width} ${height}`, width, height, role: 'img' });
  const title = svg('title', {});
  title.textContent = model.caption;
  root.appendChild(title);
  const text = (x: number, y: number, value: string, attrs: { [k: string]: string | number } = {}) => {
    const t = svg('text', { x, y, 'font-size': 10, fill: 'currentColor', ...attrs });
    t.textContent = value;
    root.appendChild(t);
  };
  text(plot.left, 12, model.title, { 'font-size': 11, 'font-weight': 'bold', 'data-air-magic-chart-title': '1' });
  root.appendChild(svg('rect', { x: plot.left, y: plot.top, width: plot.width, height: plot.height,
    fill: 'none', stroke: 'currentColor', 'stroke-opacity': 0.25 }));
  text(plot.left - 4, plot.top + 8, labels.y_top, { 'text-anchor': 'end' });
  text(plot.left - 4, plot.top + plot.height, labels.y_bottom, { 'text-anchor': 'end' });
  text(plot.left, height - 3, labels.x_left);
  text(plot.left + plot.width, height - 3, labels.x_right, { 'text-anchor': 'end' });
  let index = 0;
  for (const [rank, points] of Object.entries(model.lines)) {
    const color = RANK_COLORS[Number(rank) % RANK_COLORS.length];
    const coords = points.map(([x, y]) => `${Number(x).toFixed(1)},${Number(y).toFixed(1)}`).join(' ');
    root.appendChild(svg('polyline', { points: coords, fill: 'none', stroke: color,
      'stroke-width': Math.max(1, 2.6 - 0.5 * index), 'stroke-linejoin': 'round', 'data-rank': rank }));
    const [lx, ly] = points[points.length - 1];
    root.appendChild(svg('circle', { cx: Number(lx), cy: Number(ly), r: Math.max(1.8, 4 - 0.6 * index),
      fill: Number(rank) === 0 ? color : 'none', stroke: color, 'data-rank': rank }));
    index++;
  }
  figure.appendChild(root);
  figure.appendChild(el('figcaption', {}, model.caption));
  return figure;
}

export const rendererFactory: IRenderMime.IRendererFactory = {
  safe: true,
  mimeTypes: [SUMMARY_MIME],
  createRenderer: () => new SummaryRenderer()
};

const extension: IRenderMime.IExtension = {
  id: 'air-magic-labextension:summary',
  rendererFactory,
  rank: 40, // before text/html (50): the HTML form is for front ends without this renderer
  dataType: 'json'
};

export default extension;

/** A button that copies ``text`` (the command that opens the run's store); where the page may
 * not write the clipboard (a server reached over plain HTTP), it selects ``node``'s text for
 * Ctrl+C instead, and says so. */
function copyButton(node: HTMLElement, text: string): HTMLElement {
  const button = el('button', { class: 'air-magic-copy', 'data-air-magic-copy': '1', title: 'Copy the command' }, 'Copy');
  const say = (word: string): void => {
    button.textContent = word;
    window.setTimeout(() => {
      button.textContent = 'Copy';
    }, 2000);
  };
  const select = (): void => {
    const range = document.createRange();
    range.selectNodeContents(node);
    const selection = window.getSelection();
    selection?.removeAllRanges();
    selection?.addRange(range);
    say('Selected: press Ctrl+C');
  };
  button.addEventListener('click', () => {
    if (!navigator.clipboard?.writeText) {
      select();
      return;
    }
    navigator.clipboard.writeText(text).then(() => say('Copied'), select);
  });
  return button;
}
