"""backends/: what runs ranks for the kernel -- the Backend interface (base), the local forked
helper (local), and Ray (ray/: the kernel's backend, the per-rank agent and rank entry, ray_init).
Imports rank/, protocol/, settings and accelerators; never kernel/ (which sits above it).
"""
