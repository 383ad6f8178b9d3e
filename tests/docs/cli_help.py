#!/usr/bin/env python3
"""composer --help and composer COMMAND --help against the docs.

Both helps are generated from runner/cli/commands.cpp's tables. This checks
that README.md's "Commands and exit codes" table names the same commands, each
with the options that belong to it (and the options of every command in its
"options of every command" row), and that README.md's exit rows and
docs/launching.md#exit-codes list the same exit codes as --help, each row
containing the code's name (its meaning up to the first ':', '(', ',' or ';').

usage: cli_help.py COMPOSER [ROOT]. Prints FILE: PROBLEM for each mismatch and
exits 1 if any.
"""
import re
import subprocess
import sys
from pathlib import Path


def helped(composer, *command):
    out = subprocess.run([composer, *command, "--help"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"composer {' '.join(command)} --help exited {out.returncode}: {out.stderr}")
    return out.stdout


def section(text, title):
    """The lines of a help section, from its title to the next blank line."""
    lines = text.split(f"\n{title}\n", 1)[1].split("\n\n", 1)[0]
    return lines.splitlines()


def option_names(lines):
    return {m.group(1) for line in lines if (m := re.match(r"\s+(?:-\w, )?--([\w-]+)", line))}


def exit_codes(lines):
    """{code: its name} from --help's exit-code lines."""
    codes = {}
    for line in lines:
        if m := re.match(r"  (\d+)\s+(.*)", line):
            codes[int(m.group(1))] = re.split(r"[:(,;]", m.group(2))[0].strip()
    return codes


def markdown_rows(text, heading):
    """The table rows under a markdown heading, as lists of cells."""
    body = text.split(heading + "\n", 1)[1]
    body = re.split(r"\n#+ ", body, 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in body.splitlines()
            if line.startswith("|") and not line.startswith("| ---")]


def check(composer, root):
    problems = []
    overview = helped(composer)
    commands = [m.group(1) for line in section(overview, "commands:") if (m := re.match(r"  (\w+)\s", line))]
    common = option_names(section(overview, "options of every command:"))
    codes = exit_codes(section(overview, "exit codes:"))
    if set(codes) < set(range(6)):
        problems.append(f"composer --help: exit codes {sorted(codes)} lack some of 0-5")

    readme = (root / "README.md").read_text()
    rows = markdown_rows(readme, "## Commands and exit codes")
    documented = {}
    for cells in rows:
        if m := re.match(r"`composer (\w+)", cells[0]):
            documented[m.group(1)] = set(re.findall(r"--([a-z][\w-]*)", " ".join(cells))) - common
        elif cells[0].startswith("options"):
            named = set(re.findall(r"--([a-z][\w-]*)", cells[1]))
            if named != common:
                problems.append(f"README.md: the options row names {sorted(named)}; "
                                f"composer --help lists {sorted(common)} for every command")
    if set(documented) != set(commands):
        problems.append(f"README.md: the commands table names {sorted(documented)}; "
                        f"composer --help lists {sorted(commands)}")
    for name in commands:
        text = helped(composer, name)
        own = option_names(section(text, f"options of composer {name}:")) if f"options of composer {name}:" in text \
            else set()
        if name in documented and documented[name] != own:
            problems.append(f"README.md: composer {name}'s row names {sorted(documented[name])}; "
                            f"composer {name} --help lists {sorted(own)}")
        if exit_codes(section(text, "exit codes:")) != codes:
            problems.append(f"composer {name} --help: its exit codes differ from composer --help's")

    readme_exits = {int(m.group(1)): " ".join(cells) for cells in rows if (m := re.match(r"exit (\d+)$", cells[0]))}
    launching = (root / "docs" / "launching.md").read_text()
    launching_exits = {int(cells[0]): " ".join(cells) for cells in markdown_rows(launching, "## Exit codes")
                       if cells[0].isdigit()}
    for page, exits in (("README.md", readme_exits), ("docs/launching.md#exit-codes", launching_exits)):
        if set(exits) != set(codes):
            problems.append(f"{page}: exit codes {sorted(exits)}; composer --help lists {sorted(codes)}")
        for code, name in codes.items():
            if code in exits and name.lower() not in exits[code].lower():
                problems.append(f"{page}: exit {code}'s row does not say '{name}' (composer --help's name for it)")
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    root = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parents[2]
    sys.exit(check(sys.argv[1], root))
