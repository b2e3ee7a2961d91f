"""rank/inspect/: looking inside a running rank, the rank's half; it imports protocol/ and the
rank's own interrupts and patching, nothing of the rank's launch or pool.

pdb at a breakpoint with its prompt in the notebook (``debugger``), the rank's collectives
read from torch's Flight Recorder for the kernel (``collectives``), and the thread and signals
that answer the kernel's requests for the rank's stacks (``stacks``).  The kernel's half is
:mod:`air_magic.kernel.inspect`."""
