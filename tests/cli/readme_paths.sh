#!/usr/bin/env bash
# Every repository path README.md names exists (globs match something;
# <name> placeholders are skipped), so the README does not point at files
# the repository does not have.
# Usage: readme_paths.sh   (from the repository root)
set -u
missing=0 checked=0
# Paths under build/ (build outputs) are not the repository's.
for p in $(grep -oE '(^|[^/A-Za-z0-9_.-])(configs|tools|docs|tests|runner|models|parallelisms)/[A-Za-z0-9_./*-]*[A-Za-z0-9_*/]' README.md |
           sed 's|^[^a-z]||' | sort -u); do
  case "$p" in *'<'*) continue ;; esac
  checked=$((checked + 1))
  # shellcheck disable=SC2086
  if ! ls -d $p >/dev/null 2>&1; then echo "README.md names $p, which does not exist"; missing=$((missing + 1)); fi
done
for p in $(grep -oE '\]\([^)#:]+\)' README.md | sed 's/^](//; s/)$//' | sort -u); do
  checked=$((checked + 1))
  [ -e "$p" ] || { echo "README.md links to $p, which does not exist"; missing=$((missing + 1)); }
done
[ $checked -gt 10 ] || { echo "FAIL: found only $checked paths; the pattern is broken"; exit 1; }
[ $missing -eq 0 ] || { echo "FAIL: $missing missing paths"; exit 1; }
echo "ok: all $checked paths README.md names exist"
