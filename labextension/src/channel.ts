/**
 * The comm to a kernel's air_magic (kernel side: air_magic/panel/_lab.py).
 *
 * The kernel only registers the comm target "air_magic" (as air_magic is imported): the
 * page opens the comm, once it has reason to think air_magic is in the kernel, so a
 * kernel never opens a comm that a front end without this extension would not know.
 *
 *   a cell whose code names air_magic (iopub execute_input) has ended (its status idle),
 *   and no comm yet --comm_open {"type": "list"}--> {"type": "launches"}: connected
 *        <--comm_close-- no target (air_magic not imported): wait for the next such cell
 *   the kernel connected (a page loaded on a kernel that has air_magic)
 *        --comm_info_request--> an open comm of the target: adopted, {"type": "list"}
 *   kernel --{"type": "launches"}--> launches, changed signal (the sidebar, the status bar)
 *   Stop --{"type": "stop"}--> (on a kernel subshell: handled while a cell blocks the kernel;
 *        without subshells a blocking launch is stopped by interrupting the kernel)
 *   rank log --{"type": "log"}--> {"type": "reply", "text"}
 *
 * No timers, no polling: the kernel is asked once when it connects, and after a cell that
 * names air_magic until a comm is open.  The comm's messages go on its kernel subshell
 * (JupyterLab >= 4.4 starts one per comm target where the kernel has them), the open
 * included: the list arrives while a cell started after the import still runs.
 */
import { ISessionContext } from '@jupyterlab/apputils';
import { Kernel, KernelMessage } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

export const TARGET = 'air_magic';

/** The code of a cell after which air_magic may be in the kernel. */
const NAMES_AIR_MAGIC = /air_magic|^\s*%%distributed\b/m;

export interface IRank {
  rank: number;
  state: string;
  pid: number | null;
  returncode: number | null;
  /** The rank's tqdm bar, "45%" ('' when it shows none). */
  progress?: string;
}

/** A pool's own facts (kernel: pool.state, restarts, cells run); its launches share one item. */
export interface IPool {
  state: string;
  restarts: number | null;
  calls: number | null;
}

export interface ILaunch {
  id: string;
  /** The sidebar item it is shown as: a pool's key (the same across its restarts), else its id. */
  item?: string;
  pool?: IPool;
  label: string;
  kind: string;
  status: string;
  where: string;
  world_size: number;
  ranks: IRank[];
  started_at: number;
  ended_at: number | null;
  elapsed: number;
  outcome: string;
  blocking: boolean;
  cell: { id?: string; execution_count?: number | null };
  run: { id: string; name: string; url: string } | null;
}

export interface IReply {
  ok: boolean;
  error?: string;
  [key: string]: unknown;
}

/** States in which nothing runs: a launch that ended, a pool between its cells or broken. */
const NOT_RUNNING = new Set(['finished', 'failed', 'timed out', 'cancelled', 'idle', 'broken', 'closed']);

export function isRunning(launch: ILaunch): boolean {
  return !NOT_RUNNING.has(shownStatus(launch));
}

/**
 * The state the sidebar and the status bar say: a launch's own, but for a pool's launch
 * (which runs as long as the pool lives) the pool's, as the kernel's pool.state says it:
 * idle between its cells, running while a cell runs, broken, closed.
 */
export function shownStatus(launch: ILaunch): string {
  if (launch.pool) {
    return launch.pool.state === 'new' ? 'starting' : launch.pool.state;
  }
  return launch.status;
}

/**
 * One notebook's kernel, as air_magic sees it.
 */
export class KernelChannel {
  constructor(readonly sessionContext: ISessionContext) {
    sessionContext.kernelChanged.connect(this._onKernelChanged, this);
    this._follow(sessionContext.session?.kernel ?? null);
  }

  /** Whether the kernel has air_magic (a comm is open and the kernel sent its list). */
  get connected(): boolean {
    return this._comm !== null && this._listed;
  }

  get launches(): ILaunch[] {
    return this._launches;
  }

  /** The kernel's clock minus this page's (seconds), for elapsed times. */
  get skew(): number {
    return this._skew;
  }

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get kernel(): Kernel.IKernelConnection | null {
    return this._kernel;
  }

  /** Stop a launch: a message to the kernel, or the kernel interrupt for a blocking
   * launch when the comm has no subshell to arrive on while the cell runs. */
  async stop(launch: ILaunch): Promise<IReply> {
    const comm = this._comm;
    if (!comm || !this._kernel) {
      return { ok: false, error: 'the kernel has no air_magic channel' };
    }
    const onSubshell = !!(comm as any).subshellId;
    if (launch.blocking && !onSubshell) {
      await this._kernel.interrupt();
      return { ok: true, interrupted: true };
    }
    return this.request({ type: 'stop', launch: launch.id });
  }

  /** Close a pool (its ranks end, their names are lost: the sidebar asks the user first). */
  close(launch: ILaunch): Promise<IReply> {
    return this.request({ type: 'close', launch: launch.id });
  }

  /** The end of a rank's log. */
  log(launch: ILaunch, rank: number): Promise<IReply> {
    return this.request({ type: 'log', launch: launch.id, rank });
  }

  request(data: { [key: string]: string | number }): Promise<IReply> {
    const comm = this._comm;
    if (!comm) {
      return Promise.resolve({ ok: false, error: 'the kernel has no air_magic channel' });
    }
    const id = `${this._prefix}-${++this._next}`;
    return new Promise<IReply>(resolve => {
      this._pending.set(id, resolve);
      comm.send({ ...data, request: id });
    });
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    this.sessionContext.kernelChanged.disconnect(this._onKernelChanged, this);
    this._follow(null);
    Signal.clearData(this);
  }

  private _onKernelChanged(
    _: ISessionContext,
    change: { newValue: Kernel.IKernelConnection | null }
  ): void {
    this._follow(change.newValue);
  }

  private _follow(kernel: Kernel.IKernelConnection | null): void {
    if (this._kernel) {
      this._kernel.statusChanged.disconnect(this._onStatus, this);
      this._kernel.connectionStatusChanged.disconnect(this._onConnection, this);
      this._kernel.iopubMessage.disconnect(this._onIOPub, this);
    }
    this._reset();
    this._kernel = kernel;
    if (!kernel) {
      return;
    }
    kernel.statusChanged.connect(this._onStatus, this);
    kernel.connectionStatusChanged.connect(this._onConnection, this);
    kernel.iopubMessage.connect(this._onIOPub, this);
    if (kernel.connectionStatus === 'connected') {
      void this._findOpen();
    }
  }

  private _onStatus(kernel: Kernel.IKernelConnection): void {
    if (kernel.status === 'restarting' || kernel.status === 'autorestarting' || kernel.status === 'dead') {
      this._reset();
    }
  }

  private _onConnection(kernel: Kernel.IKernelConnection): void {
    if (kernel.connectionStatus === 'connected' && !this._comm) {
      void this._findOpen();
    }
  }

  /** A cell that names air_magic, then its end: the moment to open the comm. */
  private _onIOPub(kernel: Kernel.IKernelConnection, msg: KernelMessage.IIOPubMessage): void {
    if (kernel !== this._kernel || this.connected) {
      return;
    }
    const cell = (msg.parent_header as Partial<KernelMessage.IHeader>).msg_id;
    if (!cell) {
      return;
    }
    if (KernelMessage.isExecuteInputMsg(msg)) {
      if (NAMES_AIR_MAGIC.test(msg.content.code)) {
        this._cells.add(cell);
      }
    } else if (
      KernelMessage.isStatusMsg(msg) &&
      msg.content.execution_state === 'idle' &&
      this._cells.delete(cell)
    ) {
      void this._open();
    }
  }

  /** Open a comm to the kernel's target; a kernel without air_magic answers with a close. */
  private async _open(): Promise<void> {
    const kernel = this._kernel;
    if (!kernel || this.connected) {
      return;
    }
    if (this._opening || this._looking || this._comm) {
      this._again = true; // tried again if the comm on its way is refused
      return;
    }
    this._opening = true;
    this._again = false;
    try {
      const comm = kernel.createComm(TARGET);
      await onItsSubshell(kernel, comm);
      if (kernel !== this._kernel || this._comm) {
        comm.dispose();
        return;
      }
      this._adopt(comm);
      comm.open({ type: 'list' });
    } catch {
      // a kernel that went away meanwhile: its next start says so
    } finally {
      this._opening = false;
    }
  }

  /** A kernel that has air_magic's comm open already (this page was reloaded): adopt it. */
  private async _findOpen(): Promise<void> {
    const kernel = this._kernel;
    if (!kernel || this._comm || this._looking || this._opening) {
      return;
    }
    this._looking = true;
    try {
      const reply = await kernel.requestCommInfo({ target_name: TARGET });
      const content = reply.content as any;
      if (content.status !== 'ok' || this._comm || kernel !== this._kernel) {
        return;
      }
      const id = Object.keys(content.comms ?? {}).find(
        id => content.comms[id].target_name === TARGET && !kernel.hasComm(id)
      );
      if (id) {
        const comm = kernel.createComm(TARGET, id);
        await onItsSubshell(kernel, comm);
        if (kernel !== this._kernel || this._comm) {
          comm.dispose();
          return;
        }
        this._adopt(comm);
        comm.send({ type: 'list' });
      }
    } catch {
      // a kernel that went away meanwhile: its next start says so
    } finally {
      this._looking = false;
      if (this._again && !this._comm) {
        void this._open();
      }
    }
  }

  private _adopt(comm: Kernel.IComm): void {
    this._comm = comm;
    comm.onMsg = (msg: KernelMessage.ICommMsgMsg) => this._onData(msg.content.data as any);
    comm.onClose = () => {
      if (this._comm !== comm) {
        return;
      }
      // Closed before the list came: the kernel has no such target (yet).
      const retry = !this._listed && this._again;
      this._reset();
      if (retry) {
        void this._open();
      }
    };
  }

  private _onData(data: any): void {
    if (!data || typeof data !== 'object') {
      return;
    }
    if (data.type === 'launches') {
      this._listed = true;
      this._launches = Array.isArray(data.launches) ? data.launches : [];
      if (typeof data.now === 'number') {
        this._skew = data.now - Date.now() / 1000;
      }
      this._changed.emit();
    } else if (data.type === 'reply' && typeof data.request === 'string') {
      const resolve = this._pending.get(data.request);
      if (resolve) {
        this._pending.delete(data.request);
        resolve(data as IReply);
      }
    }
  }

  private _reset(): void {
    const had = this.connected || this._launches.length > 0;
    this._comm = null;
    this._listed = false;
    this._again = false;
    this._cells.clear();
    this._launches = [];
    for (const resolve of this._pending.values()) {
      resolve({ ok: false, error: 'the kernel went away' });
    }
    this._pending.clear();
    if (had) {
      this._changed.emit();
    }
  }

  private _kernel: Kernel.IKernelConnection | null = null;
  private _comm: Kernel.IComm | null = null;
  private _launches: ILaunch[] = [];
  private _skew = 0;
  private _listed = false;
  private _looking = false;
  private _opening = false;
  private _again = false;
  private _cells = new Set<string>(); // the running cells that name air_magic
  private _disposed = false;
  private _next = 0;
  private _prefix = Math.random().toString(36).slice(2, 10);
  private _pending = new Map<string, (reply: IReply) => void>();
  private _changed = new Signal<this, void>(this);
}

/**
 * Wait until the comm has its kernel subshell, where it gets one (JupyterLab >= 4.4 starts
 * it as the comm is created, and the kernel advertises subshells): what is sent on it is
 * then handled while a cell keeps the main shell busy.
 */
async function onItsSubshell(kernel: Kernel.IKernelConnection, comm: Kernel.IComm): Promise<void> {
  await kernel.info;
  const started: Promise<void> | undefined = (comm as any).subshellStarted;
  const k = kernel as any;
  if (!started || !k.supportsSubshells || k.commsOverSubshells === 'disabled') {
    return;
  }
  try {
    await started;
  } catch {
    // no subshell after all: the main shell
  }
}
