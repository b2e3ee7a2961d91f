"""rank/: what runs in the helper process and in each rank -- the helper (zygote) that forks
the ranks, a rank's main, its result records, its tracking shim (MLflow calls into the spool).
Imports protocol/ and settings only: nothing of the kernel side (a rank pays for nothing else).
"""
