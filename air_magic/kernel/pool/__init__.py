"""kernel/pool/: the kernel's pool of ranks kept across cells; it imports the launch (kernel/launch.py,
kernel/launcher.py: a pool is one long launch), kernel/inspect/, protocol/ and settings.

``engine`` (PoolEngine: the pool's face and life), ``start`` (its ranks started and ended),
``mirror`` (what the ranks know of the kernel), ``wait`` (one call: sent, waited for, its
values or error), ``decide`` (the decisions as pure functions), ``call`` (one start of the
ranks, one call on them; RankCallState), ``wire`` and ``listener`` (the Unix socket to the ranks),
``interrupt`` (Ctrl-C and q: every rank stopped at one point), ``regroup`` (a fresh process group
after a cut), ``state`` (what an interrupt left, compared across ranks), ``status`` and ``view``
(what the notebook, the panel and the sidebar show of it), ``model_back`` (a model gathered from
the ranks).  The ranks' half is :mod:`air_magic.rank.pool.serve`."""
