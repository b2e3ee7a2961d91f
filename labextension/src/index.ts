/**
 * air_magic in JupyterLab and Notebook 7.
 *
 *   launches plugin   a KernelChannel per open notebook (channel.ts); the sidebar and the
 *                     status bar item follow the current notebook's (launches.ts)
 *   migrate plugin    the "Migrate from serverless_gpu" command: palette, notebook toolbar,
 *                     notebook context menu (migrate.ts, the server extension does the fixing)
 *   mime renderer     saved launch summaries (mime.ts, its own entry point: lib/mime.js)
 */
import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette, ToolbarButton } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';

import { KernelChannel } from './channel';
import { LaunchesPanel, LaunchesStatus } from './launches';
import { migrate } from './migrate';

/** The launches: four ranks (a 2x2 grid of chips, joined), not three bars that read as "pause". */
const ICON_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><g class="jp-icon3" fill="#616161">' +
  '<rect x="3" y="3" width="7" height="7" rx="1.5"/><rect x="14" y="3" width="7" height="7" rx="1.5"/>' +
  '<rect x="3" y="14" width="7" height="7" rx="1.5"/><rect x="14" y="14" width="7" height="7" rx="1.5"/>' +
  '<rect x="10" y="6" width="4" height="1.5"/><rect x="10" y="16.5" width="4" height="1.5"/>' +
  '<rect x="6" y="10" width="1.5" height="4"/><rect x="16.5" y="10" width="1.5" height="4"/></g></svg>';

/** Migrate: a page with an arrow into it (code rewritten), its own glyph. */
const MIGRATE_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><g class="jp-icon3" fill="#616161">' +
  '<path d="M13 3h6a2 2 0 0 1 2 2v14a2 2 0 0 1-2 2h-6v-2h6V5h-6z"/>' +
  '<path d="M3 11h9V7.5l5 4.5-5 4.5V13H3z"/></g></svg>';

export const airMagicIcon = new LabIcon({ name: 'air-magic:ranks', svgstr: ICON_SVG });
export const migrateIcon = new LabIcon({ name: 'air-magic:migrate', svgstr: MIGRATE_SVG });

const MIGRATE = 'air-magic:migrate';
const SHOW = 'air-magic:show-launches';

const channels = new WeakMap<NotebookPanel, KernelChannel>();

function channelOf(panel: NotebookPanel): KernelChannel {
  let channel = channels.get(panel);
  if (!channel) {
    channel = new KernelChannel(panel.sessionContext);
    channels.set(panel, channel);
    panel.disposed.connect(() => {
      channel?.dispose();
      channels.delete(panel);
    });
  }
  return channel;
}

const launches: JupyterFrontEndPlugin<void> = {
  id: 'air-magic-labextension:launches',
  description: "The current notebook's air_magic launches: a sidebar and a status bar item.",
  autoStart: true,
  requires: [INotebookTracker],
  optional: [IStatusBar, ILabShell, ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    statusBar: IStatusBar | null,
    labShell: ILabShell | null,
    palette: ICommandPalette | null
  ) => {
    const current = () => {
      const panel = tracker.currentWidget;
      return { panel, channel: panel ? channelOf(panel) : null };
    };
    const sidebar = new LaunchesPanel(current);
    sidebar.title.icon = airMagicIcon;
    sidebar.title.label = labShell ? '' : 'air_magic launches';
    app.shell.add(sidebar, labShell ? 'left' : 'right', { rank: 650 });

    const status = new LaunchesStatus(() => app.commands.execute(SHOW));
    const follow = () => {
      const { channel } = current();
      sidebar.follow(channel);
      status.follow(channel);
    };
    tracker.widgetAdded.connect((_, panel) => {
      channelOf(panel);
    });
    tracker.currentChanged.connect(follow);
    follow();

    app.commands.addCommand(SHOW, {
      label: 'Show air_magic launches',
      execute: () => {
        app.shell.activateById(sidebar.id);
      }
    });
    palette?.addItem({ command: SHOW, category: 'air_magic' });
    statusBar?.registerStatusItem('air-magic-labextension:status', {
      item: status,
      align: 'left',
      rank: 5,
      isActive: () => !!tracker.currentWidget
    });
  }
};

const migration: JupyterFrontEndPlugin<void> = {
  id: 'air-magic-labextension:migrate',
  description: 'Migrate from serverless_gpu: air-magic lint --fix on the open notebook.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ICommandPalette],
  activate: (app: JupyterFrontEnd, tracker: INotebookTracker, palette: ICommandPalette | null) => {
    app.commands.addCommand(MIGRATE, {
      label: 'Migrate from serverless_gpu',
      caption: 'Rewrite serverless_gpu code for air_magic (air-magic lint --fix), showing the changes first',
      icon: migrateIcon,
      isEnabled: () => !!tracker.currentWidget,
      execute: async () => {
        const panel = tracker.currentWidget;
        return panel ? migrate(panel) : null;
      }
    });
    palette?.addItem({ command: MIGRATE, category: 'air_magic' });
    app.contextMenu.addItem({ command: MIGRATE, selector: '.jp-Notebook', rank: 90 });
    app.docRegistry.addWidgetExtension('Notebook', {
      createNew: (panel: NotebookPanel) => {
        const button = new ToolbarButton({
          icon: migrateIcon,
          className: 'air-magic-migrate-button',
          tooltip: 'Migrate from serverless_gpu',
          onClick: () => {
            tracker.currentWidget !== panel && app.shell.activateById(panel.id);
            void migrate(panel);
          }
        });
        panel.toolbar.insertAfter('cellType', 'air-magic-migrate', button) ||
          panel.toolbar.addItem('air-magic-migrate', button);
        return button;
      }
    });
  }
};

export default [launches, migration];
