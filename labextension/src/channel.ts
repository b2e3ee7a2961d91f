/**
 * The comm to a kernel's air_magic (kernel side: air_magic/panel/_lab.py).
 *
 *   kernel --comm_open "air_magic" (at %load_ext)--> adopt it
 *   page reload, kernel already has it --requestCommInfo--> adopt the open comm by its id
 *   kernel --{"type": "launches"}--> launches, changed signal (the sidebar, the status bar)
 *   Stop --{"type": "stop"}--> (on a kernel subshell: handled while a cell blocks the kernel;
 *        without subshells a blocking launch is stopped by interrupting the kernel)
 *   rank log --{"type": "log"}--> {"type": "reply", "text"}
 *
 * Nothing is sent to a kernel that has not spoken first: no polling.
 */
import { ISessionContext } from '@jupyterlab/apputils';
import { Kernel, KernelMessage } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

export const TARGET = 'air_magic';

export interface IRank {
  rank: number;
  state: string;
  pid: number | null;
  returncode: number | null;
}

export interface ILaunch {
  id: string;
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

const ENDED = new Set(['finished', 'failed', 'timed out', 'cancelled']);

export function isRunning(launch: ILaunch): boolean {
  return !ENDED.has(launch.status);
}

/**
 * One notebook's kernel, as air_magic sees it.
 */
export class KernelChannel {
  constructor(readonly sessionContext: ISessionContext) {
    sessionContext.kernelChanged.connect(this._onKernelChanged, this);
    this._follow(sessionContext.session?.kernel ?? null);
  }

  /** Whether the kernel has air_magic loaded (a comm is open). */
  get connected(): boolean {
    return this._comm !== null;
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
    }
    this._reset();
    this._kernel = kernel;
    if (!kernel) {
      return;
    }
    kernel.statusChanged.connect(this._onStatus, this);
    kernel.connectionStatusChanged.connect(this._onConnection, this);
    this._register();
    if (kernel.connectionStatus === 'connected') {
      void this._findOpen();
    }
  }

  private _register(): void {
    const kernel = this._kernel;
    if (!kernel || kernel.isDisposed) {
      return;
    }
    kernel.registerCommTarget(TARGET, (comm: Kernel.IComm, msg: KernelMessage.ICommOpenMsg) => {
      this._adopt(comm);
      this._onData(msg.content.data as any);
    });
  }

  private _onStatus(kernel: Kernel.IKernelConnection): void {
    if (kernel.status === 'restarting' || kernel.status === 'autorestarting' || kernel.status === 'dead') {
      this._reset();
      this._register();
    }
  }

  private _onConnection(kernel: Kernel.IKernelConnection): void {
    if (kernel.connectionStatus === 'connected' && !this._comm) {
      void this._findOpen();
    }
  }

  /** A kernel that loaded air_magic before this page opened has its comm open: adopt it. */
  private async _findOpen(): Promise<void> {
    const kernel = this._kernel;
    if (!kernel || this._comm || this._looking) {
      return;
    }
    this._looking = true;
    try {
      const reply = await kernel.requestCommInfo({ target_name: TARGET });
      const content = reply.content as any;
      if (content.status !== 'ok' || this._comm || kernel !== this._kernel) {
        return;
      }
      const ids = Object.keys(content.comms ?? {}).filter(
        id => content.comms[id].target_name === TARGET
      );
      if (ids.length && !kernel.hasComm(ids[0])) {
        const comm = kernel.createComm(TARGET, ids[0]);
        this._adopt(comm);
        comm.send({ type: 'list' });
      }
    } catch {
      // a kernel that went away meanwhile: its next start says so
    } finally {
      this._looking = false;
    }
  }

  private _adopt(comm: Kernel.IComm): void {
    if (this._comm && this._comm !== comm) {
      this._comm.dispose();
    }
    this._comm = comm;
    comm.onMsg = (msg: KernelMessage.ICommMsgMsg) => this._onData(msg.content.data as any);
    comm.onClose = () => {
      if (this._comm === comm) {
        this._reset();
      }
    };
    this._changed.emit();
  }

  private _onData(data: any): void {
    if (!data || typeof data !== 'object') {
      return;
    }
    if (data.type === 'launches') {
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
    const had = this._comm !== null || this._launches.length > 0;
    this._comm = null;
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
  private _looking = false;
  private _disposed = false;
  private _next = 0;
  private _prefix = Math.random().toString(36).slice(2, 10);
  private _pending = new Map<string, (reply: IReply) => void>();
  private _changed = new Signal<this, void>(this);
}
