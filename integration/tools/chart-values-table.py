#!/usr/bin/env python3
"""Writes the values table of a Helm chart's README from the `# --` comments of its
values.yaml, between the markers `<!-- values:start -->` and `<!-- values:end -->`.

Every key must carry a `# --` comment (continued on the following `#` lines, up to a
bare `#`); a key without one is an error, so the table cannot silently miss a value.
Each top-level key becomes a section with its description, followed by a table of its
leaf keys (path, type, default, description). `make generate` runs this and
`make generate-check` fails when the committed README differs.

A line-based reader on purpose: it must see comments, which YAML parsers drop, and it
needs nothing beyond Python's standard library on a CI machine.

Usage: chart-values-table.py CHART_DIR
"""

import re
import sys
from pathlib import Path

KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?P<rest>.*)$")
START, END = "<!-- values:start -->", "<!-- values:end -->"


def value_type(text):
    if text in ("true", "false"):
        return "bool"
    if re.fullmatch(r"-?[0-9]+", text):
        return "int"
    if text.startswith("["):
        return "list"
    if text.startswith("{"):
        return "object"
    return "string"


def parse(values_path):
    """(path, description, rest) for every key, in file order."""
    keys, stack, comment, collecting = [], [], [], False
    for number, line in enumerate(values_path.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("# --"):
            comment, collecting = [stripped[4:].strip()], True
            continue
        if stripped.startswith("#"):
            if collecting and stripped != "#":
                comment.append(stripped[1:].strip())
            else:
                collecting = False
            continue
        match = KEY.match(line)
        if not match or not stripped:
            collecting = False
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = [key for _, key in stack] + [match["key"]]
        if not comment:
            sys.exit(f"{values_path}:{number}: {'.'.join(path)} has no '# --' comment: describe it")
        rest = match["rest"].split(" #", 1)[0].strip()
        keys.append((path, " ".join(comment), rest))
        stack.append((indent, match["key"]))
        comment, collecting = [], False
    return keys


def render(keys):
    out = []
    for index, (path, description, rest) in enumerate(keys):
        if len(path) == 1:
            out += ["", f"### `{path[0]}`", "", description, "",
                    "| key | type | default | description |", "|---|---|---|---|"]
            continue
        is_section = rest == "" and index + 1 < len(keys) and keys[index + 1][0][:-1] == path
        if is_section:
            continue
        default = rest if rest else '""'
        cell = description.replace("|", "\\|")
        out.append(f"| `{'.'.join(path)}` | {value_type(rest)} | `{default}` | {cell} |")
    return "\n".join(out).lstrip("\n")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: chart-values-table.py CHART_DIR")
    chart = Path(sys.argv[1])
    readme = chart / "README.md"
    text = readme.read_text()
    if START not in text or END not in text:
        sys.exit(f"{readme}: add the markers {START} and {END} where the table goes")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    table = render(parse(chart / "values.yaml"))
    updated = f"{head}{START}\n{table}\n{END}{tail}"
    # Written only when it changes: tests include the README, and a new mtime would
    # make cargo rebuild them.
    if updated != text:
        readme.write_text(updated)


if __name__ == "__main__":
    main()
