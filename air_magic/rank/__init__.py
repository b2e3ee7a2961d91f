"""rank/: what runs in the helper process and in each rank -- the helper (zygote) that forks
the ranks, a rank's main, its output (log and streams), its result records, its tracking shim
(MLflow calls into the spool), and the rooms ``pool/`` and ``inspect/``.
Imports protocol/ and settings only: nothing of the kernel side (a rank pays for nothing else).
"""
