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

const ICON_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><g class="jp-icon3" fill="#616161">' +
  '<rect x="3" y="4" width="4" height="16" rx="1"/><rect x="10" y="4" width="4" height="16" rx="1"/>' +
  '<rect x="17" y="4" width="4" height="16" rx="1"/></g></svg>';

export const airMagicIcon = new LabIcon({ name: 'air-magic:ranks', svgstr: ICON_SVG });

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
      icon: airMagicIcon,
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
          icon: airMagicIcon,
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
