"""kernel/inspect/: looking inside running ranks, the kernel's half; it imports protocol/, settings and
the ranks' stack reading (kernel/rank_output.py), nothing of the launch or the pool (they import it).

The debugger's prompts (``debugger``), the ranks' collectives as their Flight Recorders hold
them (``collectives``), and the hang report built from them (``hangs``).  The ranks' half is
:mod:`air_magic.rank.inspect`."""
