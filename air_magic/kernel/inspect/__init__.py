"""kernel/inspect/: looking inside running ranks, the kernel's half; it imports protocol/ and
settings, nothing of the launch or the pool (they import it).

The debugger's prompts (``debugger``), where each rank is from its stacks and the stall watch
(``stacks``), the ranks' collectives as their Flight Recorders hold them (``collectives``), and
the hang watch and the report it makes (``hangs``, ``hang_report``).  The ranks' half is
:mod:`air_magic.rank.inspect`, at the same path."""
