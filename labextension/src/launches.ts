/**
 * The sidebar of the current notebook's launches, and the status bar item.
 *
 *   KernelChannel.changed --> LaunchesPanel.render(): one item per launch (label, ranks and
 *   their states, state, elapsed, outcome, MLflow run), with Stop, a button per rank's log
 *   and "cell" (jump to the cell that started it)
 *   a one-second clock only while a launch runs (the elapsed times; the kernel is not asked)
 *   under them, MachineList (machine.ts): every launch and pool on this machine, Stop on yours
 */
import { Message } from '@lumino/messaging';
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { NotebookPanel } from '@jupyterlab/notebook';
import { Widget } from '@lumino/widgets';

import { ILaunch, IReply, isRunning, KernelChannel, shownStatus } from './channel';
import { el, formatElapsed, STATUS_ICON } from './dom';
import { MachineList } from './machine';

/** Where the sidebar finds the current notebook and its channel. */
export interface ICurrent {
  panel: NotebookPanel | null;
  channel: KernelChannel | null;
}

export class LaunchesPanel extends Widget {
  constructor(private _current: () => ICurrent) {
    super();
    this.id = 'air-magic-launches';
    this.addClass('air-magic-Launches');
    this.title.caption = 'air_magic launches';
    this._machine = new MachineList(() => this.isVisible);
    this.render();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this._machine.start();
  }

  protected onBeforeHide(msg: Message): void {
    super.onBeforeHide(msg);
    this._machine.stop();
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    if (this.isVisible) {
      this._machine.start();
    }
  }

  protected onBeforeDetach(msg: Message): void {
    this._machine.stop();
    super.onBeforeDetach(msg);
  }

  /** Follow another channel (the current notebook changed) or redraw this one. */
  follow(channel: KernelChannel | null): void {
    if (channel !== this._channel) {
      this._channel?.changed.disconnect(this.render, this);
      this._channel = channel;
      channel?.changed.connect(this.render, this);
    }
    this.render();
  }

  render(): void {
    const { panel, channel } = this._current();
    const node = this.node;
    node.textContent = '';
    node.appendChild(el('h3', { class: 'air-magic-Launches-title' }, 'air_magic launches'));
    if (!panel) {
      node.appendChild(el('p', { class: 'air-magic-muted' }, 'Open a notebook to see its launches.'));
      this._clock(false);
      node.appendChild(this._machine.node);
      return;
    }
    node.appendChild(el('div', { class: 'air-magic-muted' }, panel.context.localPath));
    if (!channel || !channel.connected) {
      node.appendChild(
        el(
          'p',
          { class: 'air-magic-muted', 'data-air-magic-empty': 'no-kernel' },
          'air_magic is not loaded in this kernel: run %load_ext air_magic.'
        )
      );
      this._clock(false);
      node.appendChild(this._machine.node);
      return;
    }
    const launches = channel.launches;
    if (!launches.length) {
      node.appendChild(
        el('p', { class: 'air-magic-muted', 'data-air-magic-empty': 'none' }, 'No launch yet in this kernel.')
      );
    }
    const list = el('ul', { class: 'air-magic-Launches-list' });
    for (const launch of launches) {
      list.appendChild(this._item(launch, channel, panel));
    }
    node.appendChild(list);
    node.appendChild(this._machine.node);
    this._clock(launches.some(isRunning));
  }

  private _item(launch: ILaunch, channel: KernelChannel, panel: NotebookPanel): HTMLElement {
    const running = isRunning(launch);
    const status = shownStatus(launch);
    const pool = launch.kind === 'pool';
    const elapsed = running ? Date.now() / 1000 + channel.skew - launch.started_at : launch.elapsed;
    const item = el('li', {
      class: 'air-magic-Launch',
      'data-air-magic-item': launch.item ?? launch.id,
      'data-status': status
    });
    const head = el('div', { class: 'air-magic-Launch-head' });
    head.appendChild(
      el('span', { class: `air-magic-status air-magic-status-${status.replace(' ', '-')}` },
        `${STATUS_ICON[status] ?? '●'} ${status}`)
    );
    head.appendChild(el('b', { class: 'air-magic-Launch-label' }, launch.label));
    if (!(pool && !running)) {  // a pool between its cells (or broken, or closed) has no clock to show
      head.appendChild(el('span', { class: 'air-magic-elapsed', 'data-started': String(launch.started_at) },
        formatElapsed(elapsed)));
    }
    item.appendChild(head);
    const ranks = el('div', { class: 'air-magic-Launch-ranks' }, `${launch.where}: `);
    for (const rank of launch.ranks) {
      const button = el(
        'button',
        {
          class: 'air-magic-rank',
          'data-rank': String(rank.rank),
          'data-state': rank.state,
          title: `rank ${rank.rank} (${rank.state}${rank.pid ? `, pid ${rank.pid}` : ''}): open its log`
        },
        `r${rank.rank} ${rank.state}${rank.progress ? ` ${rank.progress}` : ''}`
      );
      button.onclick = () => void this._showLog(channel, launch, rank.rank);
      ranks.appendChild(button);
    }
    item.appendChild(ranks);
    if (launch.pool && launch.pool.state !== 'closed') {
      const { calls, restarts } = launch.pool;
      const facts = [`${calls ?? 0} cell${calls === 1 ? '' : 's'} run`];
      if (restarts) {
        facts.push(`restarted ${restarts}×`);
      }
      item.appendChild(el('div', { class: 'air-magic-muted air-magic-Pool-facts' }, facts.join(' · ')));
    }
    if (launch.outcome && !pool) {  // a pool's launch ends when the pool does: "closed" says it
      // A narrow sidebar: "cancelled after 6.2 s", the error's sentence on hover (the cell has it whole).
      const short = launch.outcome.split(': ')[0];
      item.appendChild(el('div', { class: 'air-magic-Launch-outcome', title: launch.outcome }, short));
    }
    if (launch.run) {
      const run = el('div', { class: 'air-magic-run' }, 'MLflow run ');
      const name = launch.run.name || launch.run.id.slice(0, 12);
      if (/^https?:\/\//.test(launch.run.url)) {
        run.appendChild(el('a', { href: launch.run.url, target: '_blank', rel: 'noopener' }, name));
      } else {
        run.appendChild(el('span', { title: launch.run.id }, name));
      }
      item.appendChild(run);
    }
    const actions = el('div', { class: 'air-magic-Launch-actions' });
    if (running) {
      const stop = el('button', { class: 'jp-mod-styled jp-mod-warn air-magic-stop' }, 'Stop');
      stop.title = pool
        ? 'Interrupt the running pool cell, as Ctrl-C does (the ranks and their state stay)'
        : launch.blocking
          ? 'Stop this launch (its cell is running)'
          : 'Stop this background launch';
      stop.onclick = () => void act(stop, 'Stopping…', () => channel.stop(launch), 'it could not be stopped');
      actions.appendChild(stop);
    }
    if (launch.pool && launch.pool.state !== 'closed') {
      const close = el('button', { class: 'jp-mod-styled air-magic-close' }, 'Close pool');
      close.title = 'End the pool: its ranks stop, and what its cells made there is lost';
      close.onclick = () => void this._closePool(channel, launch, close);
      actions.appendChild(close);
    }
    const cell = el('button', { class: 'jp-mod-styled air-magic-cell' }, 'Go to cell');
    cell.title = launch.cell.execution_count ? `the cell In [${launch.cell.execution_count}]` : 'the cell that started it';
    cell.onclick = () => goToCell(panel, launch);
    actions.appendChild(cell);
    item.appendChild(actions);
    return item;
  }

  private async _closePool(channel: KernelChannel, launch: ILaunch, button: HTMLElement): Promise<void> {
    const n = launch.world_size;
    const running = launch.pool?.state === 'running';
    const body = el(
      'div',
      { class: 'air-magic-CloseDialog' },
      `Its ${n} rank${n === 1 ? '' : 's'} end, and everything its cells made on them (models, optimizers, data) ` +
        `is lost.${running ? ' The cell running on it now ends without values.' : ''} ` +
        'The next pool cell starts a new pool.'
    );
    const answer = await showDialog({
      title: 'Close the pool?',
      body: new Widget({ node: body }),
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Close pool' })]
    });
    if (!answer.button.accept) {
      return;
    }
    await act(button, 'Closing…', () => channel.close(launch), 'it could not be closed');
  }

  private async _showLog(channel: KernelChannel, launch: ILaunch, rank: number): Promise<void> {
    const reply = await channel.log(launch, rank);
    const body = new Widget();
    body.addClass('air-magic-LogDialog');
    if (reply.ok) {
      body.node.appendChild(el('div', { class: 'air-magic-muted' }, String(reply.path ?? '')));
      const pre = el('pre', { class: 'air-magic-log', 'data-air-magic-log': String(rank) }, String(reply.text ?? ''));
      body.node.appendChild(pre);
      requestAnimationFrame(() => (pre.scrollTop = pre.scrollHeight));
    } else {
      body.node.appendChild(el('p', {}, reply.error ?? 'no log'));
    }
    await showDialog({ title: `${launch.label}: rank ${rank} log`, body, buttons: [Dialog.okButton({ label: 'Close' })] });
  }

  private _clock(on: boolean): void {
    if (on && this._timer === null) {
      this._timer = window.setInterval(() => this._tick(), 1000);
    } else if (!on && this._timer !== null) {
      window.clearInterval(this._timer);
      this._timer = null;
    }
  }

  private _tick(): void {
    const skew = this._channel?.skew ?? 0;
    this.node.querySelectorAll('[data-air-magic-item][data-status] .air-magic-elapsed').forEach(node => {
      const item = node.closest('[data-status]') as HTMLElement;
      if (item && !['finished', 'failed', 'timed out', 'cancelled', 'idle', 'broken', 'closed'].includes(item.dataset.status ?? '')) {
        const started = Number((node as HTMLElement).dataset.started);
        node.textContent = formatElapsed(Date.now() / 1000 + skew - started);
      }
    });
  }

  dispose(): void {
    this._clock(false);
    this._machine.stop();
    super.dispose();
  }

  private _channel: KernelChannel | null = null;
  private _machine: MachineList;
  private _timer: number | null = null;
}

/** A button's request to the kernel: disabled and saying ``busy`` meanwhile; where the kernel
 * refuses, the button as it was and a dialog with the kernel's reason. */
async function act(button: HTMLElement, busy: string, request: () => Promise<IReply>, fallback: string): Promise<void> {
  const label = button.textContent ?? '';
  button.setAttribute('disabled', '');
  button.textContent = busy;
  const reply = await request();
  if (!reply.ok) {
    button.textContent = label;
    button.removeAttribute('disabled');
    void showDialog({ title: label, body: reply.error ?? fallback, buttons: [Dialog.okButton()] });
  }
}

/** Select and show the cell that started a launch (by its id, else its execution count). */
export function goToCell(panel: NotebookPanel, launch: ILaunch): boolean {
  const notebook = panel.content;
  const cells = notebook.widgets;
  let index = launch.cell.id ? cells.findIndex(c => c.model.id === launch.cell.id) : -1;
  if (index < 0 && launch.cell.execution_count) {
    index = cells.findIndex(c => (c.model as any).executionCount === launch.cell.execution_count);
  }
  if (index < 0) {
    return false;
  }
  notebook.activeCellIndex = index;
  notebook.deselectAll();
  void notebook.scrollToItem(index, 'center');
  return true;
}

/** The status bar item: "air_magic: 1 running" (a click shows the sidebar). */
export class LaunchesStatus extends Widget {
  constructor(onClick: () => void) {
    super();
    this.addClass('air-magic-Status');
    this.node.title = 'air_magic launches of this notebook\'s kernel';
    this.node.onclick = onClick;
  }

  follow(channel: KernelChannel | null): void {
    if (channel !== this._channel) {
      this._channel?.changed.disconnect(this.render, this);
      this._channel = channel;
      channel?.changed.connect(this.render, this);
    }
    this.render();
  }

  render(): void {
    const channel = this._channel;
    if (!channel || !channel.connected) {
      this.node.textContent = '';
      this.node.dataset.running = '';
      return;
    }
    const running = channel.launches.filter(isRunning).length;
    this.node.dataset.running = String(running);
    this.node.textContent = running
      ? `air_magic: ${running} running`
      : `air_magic: ${channel.launches.length ? shownStatus(channel.launches[0]) : 'idle'}`;
  }

  private _channel: KernelChannel | null = null;
}
