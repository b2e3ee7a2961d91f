/**
 * The sidebar's second list: every air_magic launch and pool on this machine, every notebook's and
 * every user's, with Stop on yours.
 *
 *   every 5 s while the sidebar is shown (and at once when it is shown again)
 *     --GET <base>/air-magic/machine--> the server extension (air_magic/kernel/machine/server.py:
 *       the rows `air-magic ps --json` prints, and GPU memory no launch holds) --> render()
 *   Stop (yours only), after a confirmation
 *     --POST <base>/air-magic/machine/stop {id}--> SIGTERM, then SIGKILL after 5 s; the launch's
 *       cell says it was stopped from the JupyterLab sidebar --> the list again
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { ServerConnection } from '@jupyterlab/services';
import { Widget } from '@lumino/widgets';

import { el } from './dom';

/** One row, as `air-magic ps --json` has it (another user's: pids, state and notebook empty). */
export interface IMachineRow {
  id: string;
  owner: string;
  kind: string;
  ranks: number;
  gpus: { index: number; uuid: string }[];
  age_s: number;
  pids: number[];
  state: string;
  notebook: string;
  kernel: string;
  label: string;
  gpu_memory?: (number | null)[];
  host_memory?: (number | null)[];
}

interface IMachine {
  user: string;
  rows: IMachineRow[];
  orphans: { pid: number; user: string; gpu_memory: number }[];
  skipped: string[];
}

/** How often the list is read while the sidebar is shown. */
export const MACHINE_POLL_MS = 5000;

async function request(path: string, init: RequestInit = {}): Promise<{ ok: boolean; body: any }> {
  const settings = ServerConnection.makeSettings();
  const url = settings.baseUrl.replace(/\/?$/, '/') + path;
  try {
    const reply = await ServerConnection.makeRequest(url, init, settings);
    let body: any = {};
    try {
      body = await reply.json();
    } catch {
      body = { message: `the server answered ${reply.status}` };
    }
    return { ok: reply.ok, body };
  } catch (error) {
    return { ok: false, body: { message: String(error) } };
  }
}

function age(seconds: number): string {
  if (seconds < 60) {
    return `${Math.round(seconds)} s`;
  }
  if (seconds < 3600) {
    return `${Math.floor(seconds / 60)} min`;
  }
  return `${Math.floor(seconds / 3600)} h ${Math.floor((seconds % 3600) / 60)} min`;
}

function size(bytes: number): string {
  return bytes >= 1 << 30 ? `${(bytes / (1 << 30)).toFixed(1)} GiB` : `${Math.round(bytes / (1 << 20))} MiB`;
}

function gpus(row: IMachineRow): string {
  if (!row.gpus.length) {
    return 'CPU';
  }
  return `GPU${row.gpus.length === 1 ? '' : 's'} ${row.gpus.map(g => g.index).join(',')}`;
}

/** The machine's list: a node the launches sidebar places under the notebook's own launches. */
export class MachineList {
  readonly node: HTMLElement = el('div', { class: 'air-magic-Machine' });

  constructor(private _visible: () => boolean) {
    this.render();
  }

  /** Read the list every MACHINE_POLL_MS while the sidebar is shown; ``start`` reads it at once. */
  start(): void {
    if (this._timer === null) {
      this._timer = window.setInterval(() => void this.refresh(), MACHINE_POLL_MS);
    }
    void this.refresh();
  }

  stop(): void {
    if (this._timer !== null) {
      window.clearInterval(this._timer);
      this._timer = null;
    }
  }

  async refresh(): Promise<void> {
    if (!this._visible() || this._busy) {
      return;
    }
    this._busy = true;
    try {
      const reply = await request('air-magic/machine');
      this._machine = reply.ok ? (reply.body as IMachine) : null;
      this._error = reply.ok ? '' : String(reply.body.message ?? 'the list could not be read');
    } finally {
      this._busy = false;
    }
    this.render();
  }

  render(): void {
    const node = this.node;
    node.textContent = '';
    node.appendChild(el('h4', { class: 'air-magic-Machine-title' }, 'On this machine'));
    if (this._error) {
      node.appendChild(el('p', { class: 'air-magic-muted', 'data-air-magic-machine': 'error' }, this._error));
      return;
    }
    const machine = this._machine;
    if (!machine) {
      node.appendChild(el('p', { class: 'air-magic-muted' }, 'Reading the machine’s launches…'));
      return;
    }
    if (!machine.rows.length) {
      node.appendChild(
        el('p', { class: 'air-magic-muted', 'data-air-magic-machine': 'none' }, 'No air_magic launch or pool runs here.')
      );
    }
    const list = el('ul', { class: 'air-magic-Machine-list' });
    for (const row of machine.rows) {
      list.appendChild(this._item(row, row.owner === machine.user || machine.user === 'root'));
    }
    node.appendChild(list);
    for (const stray of machine.orphans) {
      node.appendChild(
        el(
          'div',
          { class: 'air-magic-muted air-magic-Machine-orphan', 'data-air-magic-orphan': String(stray.pid) },
          `pid ${stray.pid} (${stray.user}) holds ${size(stray.gpu_memory)} of GPU memory, and no launch names it`
        )
      );
    }
  }

  private _item(row: IMachineRow, mine: boolean): HTMLElement {
    const item = el('li', { class: 'air-magic-Machine-item', 'data-air-magic-machine-row': row.id, 'data-mine': String(mine) });
    const head = el('div', { class: 'air-magic-Machine-head' });
    head.appendChild(el('b', {}, mine ? row.label || row.kind : `${row.owner}’s ${row.kind}`));
    head.appendChild(el('span', { class: 'air-magic-muted' }, ` · ${age(row.age_s)}`));
    item.appendChild(head);
    const facts = [`${row.kind} ${row.id}`, `${row.ranks} rank${row.ranks === 1 ? '' : 's'}`, gpus(row)];
    if (mine && row.state) {
      facts.push(row.state);
    }
    item.appendChild(el('div', { class: 'air-magic-muted' }, facts.join(' · ')));
    if (mine) {
      const where = row.notebook || (row.kernel ? `kernel ${row.kernel}` : 'a terminal');
      const onGpu = (row.gpu_memory ?? []).some(m => m);
      const memory = (onGpu ? row.gpu_memory : row.host_memory) ?? [];
      const shown = memory.filter((m): m is number => typeof m === 'number');
      const what = `${onGpu ? 'GPU' : 'host'} memory per rank`;
      item.appendChild(
        el(
          'div',
          { class: 'air-magic-muted' },
          `${where}${shown.length ? ` · ${what}: ${shown.map(size).join(', ')}` : ''}`
        )
      );
      // Red only while something runs: an idle pool has no cell to stop, only ranks to end (as Close pool).
      const idle = row.kind === 'pool' && !(row.state ?? '').startsWith('running');
      const stop = el('button', { class: `jp-mod-styled${idle ? '' : ' jp-mod-warn'} air-magic-machine-stop` }, 'Stop');
      stop.title = idle
        ? 'End this idle pool: its ranks stop (SIGTERM, then SIGKILL after 5 s) and what its cells made is lost'
        : 'Stop its ranks (SIGTERM, then SIGKILL after 5 s); its cell says it was stopped from here';
      stop.onclick = () => void this._stop(row, stop);
      const actions = el('div', { class: 'air-magic-Launch-actions' });
      actions.appendChild(stop);
      item.appendChild(actions);
    }
    return item;
  }

  private async _stop(row: IMachineRow, button: HTMLElement): Promise<void> {
    const body = el(
      'div',
      { class: 'air-magic-CloseDialog' },
      `Its ${row.ranks} rank${row.ranks === 1 ? '' : 's'} get SIGTERM, then SIGKILL after 5 s` +
        `${row.kind === 'pool' ? ', and what its cells made on them is lost' : ''}. ` +
        `Its cell${row.notebook ? ` in ${row.notebook}` : ''} says it was stopped from here.`
    );
    const answer = await showDialog({
      title: `Stop ${row.kind} ${row.id}?`,
      body: new Widget({ node: body }),
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Stop' })]
    });
    if (!answer.button.accept) {
      return;
    }
    button.setAttribute('disabled', '');
    button.textContent = 'Stopping…';
    const reply = await request('air-magic/machine/stop', { method: 'POST', body: JSON.stringify({ id: row.id }) });
    if (!reply.ok) {
      button.textContent = 'Stop';
      button.removeAttribute('disabled');
      void showDialog({ title: 'Stop', body: String(reply.body.message ?? 'it could not be stopped'), buttons: [Dialog.okButton()] });
    }
    await this.refresh();
  }

  private _machine: IMachine | null = null;
  private _error = '';
  private _busy = false;
  private _timer: number | null = null;
}
