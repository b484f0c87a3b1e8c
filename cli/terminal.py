"""Text from the cluster or a node agent, made safe to show on the admin's terminal.

`gpudra top`, `report`, `devices` and `migrate` print what others wrote: label values
an agent endpoint serves (any character, newlines included), claim configs a tenant
wrote, the reason phrase of an HTTP answer. A terminal acts on control characters
instead of showing them (ESC sequences set the title, clear the screen, write the
clipboard, hide text; a newline forges a table row; bidi overrides reorder what is
read), so every such string goes through `printable` on its way out, and the admin
sees a visible escape (`\\x1b`) where the text held one. JSON output needs none of
this: the encoder escapes control characters itself.
"""

from __future__ import annotations

import sys
import unicodedata
from typing import Final

__all__ = ["printable", "warn"]

# Unicode categories a terminal does not show as a glyph of their own: controls (C0,
# DEL, C1), format characters (bidi overrides, zero-width), surrogates (undecodable
# bytes), private use, unassigned, and the line and paragraph separators.
_HIDDEN: Final = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def printable(text: str, *, newlines: bool = False) -> str:
    """`text` with every character of a hidden category written as a visible escape.

    `newlines=True` keeps "\\n" as a line break, for text that is several lines by
    design (a list of problems, a YAML file); every other control character, "\\r"
    included, is escaped there too.
    """
    if text.isprintable():  # nearly every string: no character to look at
        return text
    return "".join(
        _escape(c) if unicodedata.category(c) in _HIDDEN and not (newlines and c == "\n") else c
        for c in text
    )


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def warn(command: str, message: str) -> None:
    """One line on stderr, `gpudra COMMAND: MESSAGE`, whatever `message` holds."""
    sys.stderr.write(f"gpudra {command}: {printable(message)}\n")
