"""rank/pool/interrupts/: an interrupt of a pool call, the rank's half; it imports
rank/inspect/collectives.py (the Flight Recorder's counts) and rank/patching.py, nothing else of
the rank (the debugger's files are found by name, with importlib).

``safe_point`` (a SIGINT raises only at a point every rank agrees on, outside torch's frames),
``fence`` (no collective after the interrupt completes: it raises there, hooks' included),
``regroup`` (a cut group's fresh connections, in the same ProcessGroup objects), ``state``
(what an interrupt left half-way put back; fingerprints; pool.sync).  The kernel's half is
:mod:`air_magic.kernel.pool.interrupts`, at the same path."""
