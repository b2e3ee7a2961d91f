"""kernel/pool/interrupts/: an interrupt of a pool call, the kernel's half (Ctrl-C, q at a
breakpoint, the panel's Stop, a hang's Ctrl-C); it imports kernel/pool/call.py and wire.py,
kernel/inspect/ and protocol/, nothing else of the pool.

``interrupt`` (Interrupt: every rank stopped at one point, or the pool broken saying where each
was), ``regroup`` (the group's connections cut where a collective cannot complete, and rebuilt),
``state`` (what each rank's interrupt left, compared: "intact", or what differs and
pool.sync).  The ranks' half is :mod:`air_magic.rank.pool.interrupts`, at the same path."""
