#!/usr/bin/env python3
"""Runs a guide (docs/tutorial.md, or the one named): every ```sh block, in
order, in a scratch folder that sees the repository's configs, tools and .venv,
with composer on the PATH. A block whose first line is `# expect exit N` must
exit N; every other block must exit 0.
Usage: tutorial.py COMPOSER SCRATCH_DIR [docs/GUIDE.md]"""
import os
import re
import shutil
import subprocess
import sys

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
composer, scratch = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
guide = sys.argv[3] if len(sys.argv) > 3 else "docs/tutorial.md"
text = open(os.path.join(root, guide)).read()
blocks = re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M)
if len(blocks) < 8:
    sys.exit(f"FAIL: {guide} has {len(blocks)} sh blocks; the doc test expects the guide's commands")

shutil.rmtree(scratch, ignore_errors=True)
os.makedirs(scratch)
for name in ("configs", "tools", ".venv"):
    os.symlink(os.path.join(root, name), os.path.join(scratch, name))
env = dict(os.environ, PATH=os.path.dirname(composer) + os.pathsep + os.environ["PATH"])
for i, block in enumerate(blocks, 1):
    m = re.match(r"# expect exit (\d+)\n", block)
    want = int(m.group(1)) if m else 0
    done = subprocess.run(["bash", "-o", "pipefail", "-ec", block], cwd=scratch, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(f"--- block {i} (exit {done.returncode}, expected {want})\n{block}{done.stdout[-3000:]}")
    if done.returncode != want:
        sys.exit(f"FAIL: block {i} of {guide} exited {done.returncode}, expected {want}")
print(f"ok: the {len(blocks)} command blocks of {guide} ran as written")
