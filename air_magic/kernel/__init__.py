"""kernel/: the kernel side of a launch -- the Launcher, the Launch handle, its outcome, rank 0's
output in the cell, what the ranks inherit (the request), log folders, teardown at exit.
Imports backends/, rank/ (to read result records), the description (spec, capture) and protocol/;
never tracking/ or panel/, which plug in as observers (plugins.py).
"""
