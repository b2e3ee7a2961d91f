"""kernel/pool/: the kernel's pool of ranks kept across cells; it imports the launch (kernel/launch.py,
kernel/launcher.py: a pool is one long launch), kernel/inspect/, protocol/ and settings.

``engine`` (PoolEngine: the pool's face and life), ``start`` (its ranks started, connected to
the kernel by a socket each proves it may use, and ended), ``mirror`` (what the ranks know of
the kernel), ``wait`` (one call: sent, waited for, its values or error), ``decide`` (the
decisions as pure functions), ``call`` (one start of the ranks, one call on them;
RankCallState), ``wire`` (what travels on the connections), ``interrupts/`` (a room: Ctrl-C, q
and Stop, every rank stopped at one point and its state compared), ``status`` and ``view`` (what
the notebook, the panel and the sidebar show of it), ``model_back`` (a model gathered from the
ranks).  The ranks' half is :mod:`air_magic.rank.pool.serve`, at the same path."""
