/**
 * "Migrate from serverless_gpu": `air-magic lint --fix` on the open notebook.
 *
 *   the notebook model's cells (code: its source, others: null)
 *     --POST <base>/air-magic/migrate--> the server extension (air_magic/lint/server.py:
 *        the same fixer as `air-magic lint --fix`, no kernel needed)
 *     <-- fixed sources, a diff per changed cell, the findings left with their hints
 *   a dialog shows them; Apply writes the changed cells' sources into the model (one
 *   change per cell, each undoable in its cell); outputs and metadata are not touched
 */
import { Dialog, Notification, showDialog } from '@jupyterlab/apputils';
import { NotebookPanel } from '@jupyterlab/notebook';
import { ServerConnection } from '@jupyterlab/services';
import { Widget } from '@lumino/widgets';

import { el } from './dom';

export interface IMigration {
  sources: (string | null)[];
  changes: { cell: number; index: number; diff: string }[];
  fixed: number;
  found: number;
  remaining: { cell: number | null; index: number | null; code: string; message: string; hint: string; text: string }[];
  summary: string;
  /** The GPU shapes the migrated code asks for that this machine lacks, and how to run it here. */
  hardware?: string[];
}

export function cellSources(panel: NotebookPanel): (string | null)[] {
  const cells = panel.content.model?.cells;
  const out: (string | null)[] = [];
  if (!cells) {
    return out;
  }
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    out.push(cell.type === 'code' ? cell.sharedModel.getSource() : null);
  }
  return out;
}

export async function requestMigration(panel: NotebookPanel, sources: (string | null)[]): Promise<IMigration> {
  const settings = ServerConnection.makeSettings();
  const url = settings.baseUrl.replace(/\/?$/, '/') + 'air-magic/migrate';
  const reply = await ServerConnection.makeRequest(
    url,
    { method: 'POST', body: JSON.stringify({ sources, path: panel.context.localPath }) },
    settings
  );
  const body = await reply.json().catch(() => ({}));
  if (!reply.ok) {
    throw new Error(body.message || `the server answered ${reply.status} ${reply.statusText}`);
  }
  return body as IMigration;
}

/** Write the fixed sources into the model; false when the notebook changed meanwhile. */
export function applyMigration(panel: NotebookPanel, before: (string | null)[], migration: IMigration): boolean {
  const model = panel.content.model;
  if (!model) {
    return false;
  }
  const now = cellSources(panel);
  if (now.length !== before.length || now.some((s, i) => s !== before[i])) {
    return false;
  }
  for (const change of migration.changes) {
    const source = migration.sources[change.index];
    if (source !== null && source !== undefined) {
      model.cells.get(change.index).sharedModel.setSource(source);
    }
  }
  return true;
}

/** A cell as the notebook numbers it: "code cell 3 (In [2])", markdown cells not counted. */
export function cellName(panel: NotebookPanel, index: number): string {
  const cells = panel.content.model?.cells;
  if (!cells || index < 0 || index >= cells.length) {
    return `cell ${index + 1}`;
  }
  let ordinal = 0;
  for (let i = 0; i <= index; i++) {
    if (cells.get(i).type === 'code') {
      ordinal++;
    }
  }
  const cell = cells.get(index);
  const count = cell.type === 'code' ? (cell as unknown as { executionCount: number | null }).executionCount : null;
  return `code cell ${ordinal}${count ? ` (In [${count}])` : ''}`;
}

function body(migration: IMigration, panel: NotebookPanel): Widget {
  const widget = new Widget();
  widget.addClass('air-magic-Migration');
  const node = widget.node;
  const n = migration.changes.length;
  node.appendChild(
    el('p', { 'data-air-magic-migration': 'summary' },
      n ? `${migration.fixed} fix${migration.fixed === 1 ? '' : 'es'} in ${n} cell${n === 1 ? '' : 's'}.`
        : 'Nothing to fix automatically.')
  );
  for (const note of migration.hardware ?? []) {
    node.appendChild(el('p', { class: 'air-magic-note', 'data-air-magic-migration': 'hardware' }, note));
  }
  for (const change of migration.changes) {
    node.appendChild(el('h4', {}, cellName(panel, change.index)));
    const pre = el('pre', { class: 'air-magic-diff', 'data-air-magic-diff': String(change.index) });
    const lines = change.diff.split('\n').slice(2);
    while (lines.length && lines[lines.length - 1] === '') {
      lines.pop(); // the diff's last newline: no empty line under it
    }
    for (const line of lines) {
      const kind = line.startsWith('+') ? 'add' : line.startsWith('-') ? 'del' : line.startsWith('@@') ? 'hunk' : 'same';
      pre.appendChild(el('span', { class: `air-magic-diff-${kind}` }, line + '\n'));
    }
    node.appendChild(pre);
  }
  if (migration.remaining.length) {
    node.appendChild(el('h4', {}, 'Left to fix by hand'));
    const list = el('ul', { 'data-air-magic-migration': 'remaining' });
    for (const finding of migration.remaining) {
      const where = finding.index !== null ? `${cellName(panel, finding.index)}: ` : '';
      const li = el('li', {}, `${where}${finding.code} ${finding.message}`);
      if (finding.hint) {
        li.appendChild(el('div', { class: 'air-magic-muted' }, `→ ${finding.hint}`));
      }
      list.appendChild(li);
    }
    node.appendChild(list);
    if (migration.summary) {
      node.appendChild(el('p', { class: 'air-magic-muted' }, migration.summary));
    }
  }
  return widget;
}

/** The command: fix, show, apply on "Apply". */
export async function migrate(panel: NotebookPanel): Promise<IMigration | null> {
  await panel.context.ready;
  const before = cellSources(panel);
  let migration: IMigration;
  try {
    migration = await requestMigration(panel, before);
  } catch (error) {
    await showDialog({
      title: 'Migrate from serverless_gpu',
      body: `The migration failed: ${(error as Error).message}`,
      buttons: [Dialog.okButton()]
    });
    return null;
  }
  const buttons = migration.changes.length
    ? [Dialog.cancelButton(), Dialog.okButton({ label: 'Apply' })]
    : [Dialog.okButton({ label: 'Close' })];
  const result = await showDialog({ title: 'Migrate from serverless_gpu', body: body(migration, panel), buttons });
  if (!migration.changes.length || !result.button.accept) {
    return migration;
  }
  if (!applyMigration(panel, before, migration)) {
    await showDialog({
      title: 'Migrate from serverless_gpu',
      body: 'The notebook changed while the fixes were shown: nothing was applied. Run the command again.',
      buttons: [Dialog.okButton()]
    });
    return migration;
  }
  const n = migration.changes.length;
  Notification.success(`Migrated: ${migration.fixed} fix${migration.fixed === 1 ? '' : 'es'} in ${n} cell${n === 1 ? '' : 's'}.`, {
    autoClose: 10000,
    actions: [
      {
        label: 'Undo',
        callback: () => {
          const model = panel.content.model;
          for (const change of migration.changes) {
            const source = before[change.index];
            if (model && source !== null && change.index < model.cells.length) {
              model.cells.get(change.index).sharedModel.setSource(source);
            }
          }
        }
      }
    ]
  });
  return migration;
}
