"""Every package tools/requirements-quickstart.txt pins is installed in the tests' .venv (made from
tools/requirements.txt) at that version: the quickstart's environment is a part of the tests' own,
and its --no-deps install misses nothing the full one resolves to."""
import importlib.metadata
import os
import sys

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
wrong = []
pins = 0
for line in open(os.path.join(root, "tools", "requirements-quickstart.txt")):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, version = line.split("==")
    pins += 1
    try:
        have = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        have = "not installed"
    if have != version:
        wrong.append(f"{name}: quickstart pins {version}, the tests' environment has {have}")
if wrong:
    sys.exit("FAIL: " + "; ".join(wrong))
print(f"ok: the quickstart's {pins} pins are the tests' environment's versions")
