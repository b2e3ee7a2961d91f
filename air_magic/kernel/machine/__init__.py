"""kernel/machine/: one GPU box, many notebooks; it imports protocol/ (the machine's list, the GPU
locks), accelerators and settings, nothing of the launch's or the pool's running.

Each launch's GPU claims (``claims``: an observer that claims before the ranks start), the list
``air-magic ps`` and ``air-magic stop`` read (``ps``) and their verbs on the command line
(``verbs``), and the Jupyter server's route for the sidebar's "On this machine" (``server``)."""
