"""rank/pool/: a pool's rank, kept across cells; it imports protocol/, the rank's launch modules
(results, writing, patching, groups, tracking_shim) and rank/inspect/.

``serve`` (the rank's loop: one message of the kernel after another, in the rank's own
namespace), ``interrupts/`` (a room: a SIGINT raises at a safe point where every rank stops, no
collective completes after it, a cut group's fresh connections, what an interrupt left put
back; fingerprints; pool.sync), ``model_back`` (what this rank holds of a model).  The kernel's
half is :mod:`air_magic.kernel.pool`, at the same path."""
