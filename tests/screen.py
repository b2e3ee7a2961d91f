"""What a terminal shows of a stream of output: the rows left on its screen.

A carriage return moves the cursor to the start of its row and the text after it
overwrites what is there, character by character: a shorter text leaves the end of a
longer one on screen (the ``s]`` a progress bar leaves behind).  Only what a program's
output to a terminal needs is modelled: ``\\r``, ``\\n`` (a new row, at its start, as
the terminal driver's ONLCR makes it), backspace, wrapping at the last column, and
escape sequences dropped (colours, cursor shape, the window's title).
"""

from __future__ import annotations

import re

#: CSI sequences (colours, erase, cursor moves, bracketed paste on/off) and OSC ones (the title).
_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[=>78]")


def screen_lines(text: str, columns: int = 200) -> list[str]:
    """The rows a terminal of ``columns`` columns shows after ``text``, trailing blanks cut."""
    rows: list[list[str]] = [[]]
    col = 0
    for char in _ESCAPE.sub("", text):
        row = rows[-1]
        if char == "\n":
            rows.append([])
            col = 0
        elif char == "\r":
            col = 0
        elif char == "\b":
            col = max(0, col - 1)
        elif char in "\x07\x00":
            continue
        else:
            if col >= columns:  # the row is full: the text wraps onto a new row
                rows.append([])
                row, col = rows[-1], 0
            if col < len(row):
                row[col] = char
            else:
                row.extend(" " * (col - len(row)))
                row.append(char)
            col += 1
    return ["".join(row).rstrip() for row in rows]
