"""How sizes are said to the user: one formatter for every surface (the panel, a pool's
status, the summaries), in decimal units as the panel has always said them (MB, GB)."""

from __future__ import annotations

__all__ = ["fmt_bytes"]


def fmt_bytes(n: int | float | None) -> str:
    """``512 B``, ``120 MB``, ``1.5 GB``; ``?`` for an unknown size."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit != "GB" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"
