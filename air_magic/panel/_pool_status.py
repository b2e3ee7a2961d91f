"""A pool's status as the notebook shows it: ``%distributed_pool`` and ``Pool.current()`` (its
repr in a terminal, its HTML in a notebook) draw the same model the same way::

    PoolEngine --kernel.pool_status.facts()--> PoolFacts (the phrases and a row per rank)
        --> text/plain: kernel.pool_status.text() (the line, then a line per rank)
        --> text/html:  html() here: a bold "[air_magic]" title, the state coloured as a
                        launch's is, calls, age, restarts, the MLflow run (a link where a
                        tracking server is known), then the ranks (no column left empty) and,
                        where the run has no link, the command that opens it
    bundle() --> {"text/plain": ..., "text/html": ...}: what the magic displays
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from air_magic.panel._format import _CELL, _FONT, _STATUS_STYLE, _esc
from air_magic.panel._render import _run_command_html, _run_html

if TYPE_CHECKING:
    from air_magic.kernel.pool.status import PoolEngine, PoolFacts

__all__ = ["bundle", "html", "STATE_STYLE"]

#: How each state of a pool, and of its ranks, is drawn: the launch panel's marks and colours
#: (a rank done with the call as a finished launch, a broken pool as a failed one).
STATE_STYLE = {
    **_STATUS_STYLE,
    "new": _STATUS_STYLE["starting"],
    "idle": ("●", _STATUS_STYLE["finished"][1]),
    "done": _STATUS_STYLE["finished"],
    "broken": _STATUS_STYLE["failed"],
    "stopped": _STATUS_STYLE["cancelled"],
    "ended": _STATUS_STYLE["cancelled"],
    "closed": _STATUS_STYLE["cancelled"],
}


def _state_html(state: str) -> str:
    icon, color = STATE_STYLE.get(state, ("●", "#6b7280"))
    return f'<span style="color:{color};font-weight:bold">{icon} {_esc(state)}</span>'


def html(facts: "PoolFacts") -> str:
    parts = [
        f"<b>[air_magic] {_esc(facts.title)}</b>",
        _state_html(facts.state),
        _esc(facts.calls),
        _esc(facts.age),
    ]
    if facts.restarts:
        parts.append(_esc(facts.restarts))
    if facts.launch is not None:
        run = _run_html(facts.launch)
        if run:
            parts.append(run)
    out = [f"<div>{' · '.join(parts)}</div>"]
    if facts.broken_because:
        out.append(f'<div style="color:#dc2626">{_esc(facts.broken_because)}; the next call starts fresh ranks</div>')
    if facts.rows:
        columns = ["rank", "state"]
        with_memory = any(row.memory for row in facts.rows)
        with_call = any(row.call for row in facts.rows)
        columns += ["memory"] * with_memory + ["running"] * with_call
        head = "".join(f'<th style="{_CELL}">{name}</th>' for name in columns)
        body = []
        for row in facts.rows:
            cells = [str(row.rank), _state_html(row.state)]
            cells += [_esc(row.memory)] * with_memory + [_esc(row.call)] * with_call
            body.append("<tr>" + "".join(f'<td style="{_CELL}">{cell}</td>' for cell in cells) + "</tr>")
        out.append(
            f'<table style="border-collapse:collapse;margin:2px 0"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>"
        )
    if facts.launch is not None:
        command = _run_command_html(facts.launch)
        if command:
            out.append(command)
    return f'<div class="air-magic-pool" style="{_FONT}">{"".join(out)}</div>'


def bundle(engine: "PoolEngine") -> dict[str, str]:
    """The pool's status as the notebook displays it: text and HTML from one model."""
    from air_magic.kernel.pool import status as pool_status

    facts = pool_status.facts(engine)
    return {"text/plain": pool_status.text(engine, facts), "text/html": html(facts)}
