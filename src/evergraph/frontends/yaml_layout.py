"""Where a YAML graph file's `resources:` section is, read from its text alone,
sure or not at all: the entry-wise re-parse (`yaml_entries.py`) and the early
parse (`early.py`) cut the text there. Light on purpose (the standard library
alone): `early.py` loads it before the command's own modules."""

from __future__ import annotations

import re

#: the `resources:` key alone on its line
RESOURCES_LINE = re.compile(r"resources:(?:[ ]+(?:#.*)?)?\n")
#: a line at column 0 (not a comment): the end of `resources:`
TOP_LINE = re.compile(r"\n[^ #\n]")
#: a `*` that may start an alias (`/tmp/*.log` cannot)
_ALIAS = re.compile(r"(?:^|[\s\[{,])\*", re.M)


def may_alias(text: str) -> bool:
    """Whether `text` may hold an alias (`*name`)."""
    return "*" in text and _ALIAS.search(text) is not None


def resources_section(text: str) -> tuple[int, int, int] | None:
    """(where the `resources:` line starts, the `\\n` ending it, the `\\n` ending
    the section's last line: before the next line at column 0 that is not a
    comment, or the text's last), when the text is laid out so that the section
    can be cut out for certain: one `resources:` key alone on its line at column
    0, no CR, no tab at a line's start, no directive (`%YAML`), a line break at
    the end; else None."""
    if (
        "\r" in text
        or ("\t" in text and ("\n\t" in text or text.startswith("\t")))
        or ("%" in text and ("\n%" in text or text.startswith("%")))
        or not text.endswith("\n")
    ):
        return None
    at = 0 if text.startswith("resources:") else text.find("\nresources:") + 1
    m = RESOURCES_LINE.match(text, at) if at > 0 or text.startswith("resources:") else None
    if m is None or text.find("\nresources:", at) >= 0:
        return None
    start = m.end() - 1
    top = TOP_LINE.search(text, start)
    return at, start, top.start() if top is not None else len(text) - 1
