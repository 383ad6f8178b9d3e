#!/usr/bin/env python3
"""Checks that the documentation points only at things the repository has.

Scans README.md and docs/*.md for
  - markdown links [text](target) to local files (http(s), mailto and #anchor
    links are skipped; a #fragment is dropped; the target resolves against the
    folder of the file that names it), and
  - repository paths in backticks: `runner/...`, `parallelisms/...`, `models/...`,
    `configs/...`, `tests/...`, `tools/...`, `docs/...`, `.ci/...` without spaces
    or placeholder characters (* < { $); trailing punctuation and a :LINE
    suffix are dropped; they resolve against the repository root.
Lines inside ``` fences are code, not markdown, and are skipped.
Each must exist as a file or a folder. Prints FILE:LINE: missing TARGET for
each one that does not, then a summary line, and exits 1 if any is missing.

    python3 tests/docs/check_links.py            # from the repository root
    python3 tests/docs/check_links.py --root DIR # another checkout
"""
import argparse
import glob
import os
import re
import sys

LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"`([^`\n]+)`")
PREFIXES = ("runner/", "parallelisms/", "models/", "configs/", "tests/", "tools/", "docs/", ".ci/")
PLACEHOLDER = set(" *<{$")
SKIP_SCHEMES = ("http://", "https://", "mailto:")


def documents(root):
    files = [os.path.join(root, "README.md")] if os.path.isfile(os.path.join(root, "README.md")) else []
    return files + sorted(glob.glob(os.path.join(root, "docs", "*.md")))


def exists(path):
    # A file, or a folder (`runner/cli` and `runner/cli/` both name one).
    return os.path.exists(path)


def link_targets(line):
    for m in LINK.finditer(line):
        target = m.group(1).strip("<>")
        if target.startswith(SKIP_SCHEMES) or target.startswith("#"):
            continue
        target = target.split("#", 1)[0]
        if target:
            yield target


def code_paths(line):
    for m in CODE.finditer(line):
        text = m.group(1).strip()
        if not text.startswith(PREFIXES) or any(c in PLACEHOLDER for c in text):
            continue
        text = re.sub(r":\d+(?:-\d+)?$", "", text)  # file.cpp:42
        text = text.rstrip(".,;:)!?'\"")
        if text:
            yield text


def check(root):
    missing = []
    checked = 0
    for doc in documents(root):
        rel_doc = os.path.relpath(doc, root)
        folder = os.path.dirname(doc)
        in_fence = False
        with open(doc, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.lstrip().startswith("```"):
                    in_fence = not in_fence
                    continue
                if in_fence:
                    continue
                for target in link_targets(line):
                    checked += 1
                    if not exists(os.path.normpath(os.path.join(folder, target))):
                        missing.append(f"{rel_doc}:{number}: missing {target}")
                for target in code_paths(line):
                    checked += 1
                    if not exists(os.path.normpath(os.path.join(root, target))):
                        missing.append(f"{rel_doc}:{number}: missing {target}")
    return checked, missing


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=".", help="the repository root (default: the current folder)")
    args = parser.parse_args()
    root = os.path.abspath(args.root)
    if not os.path.isfile(os.path.join(root, "README.md")):
        print(f"{root}: no README.md here; run from the repository root or pass --root", file=sys.stderr)
        return 2
    checked, missing = check(root)
    for m in missing:
        print(m)
    print(f"links: {checked} checked, {len(missing)} missing")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
