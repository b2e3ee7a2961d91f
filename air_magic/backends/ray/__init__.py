"""backends/ray/: ranks as Ray actors on a cluster's nodes -- the kernel's backend, one launch's
thread on the cluster (ray_launch), the agent (one actor per rank, rank side), the rank entry it
starts, and ray_init (join or start a cluster).
The agent and the rank entry import rank/ and protocol/ only; the backend imports ray lazily.
"""
