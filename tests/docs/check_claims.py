#!/usr/bin/env python3
"""Checks that what README.md and docs/*.md claim about the tree is true of the tree.

Claims are written in the pages as HTML comments, which a rendered page does not show:

  <!-- not built: FRAGMENT [+ FRAGMENT ...] => tests/bad_inputs/NAME.yaml -->
  <!-- refused: FRAGMENT [+ FRAGMENT ...] => tests/bad_inputs/NAME.yaml -->
      The feature the FRAGMENTs spell in a config (YAML text, e.g. `aux_loss_coeff + context_parallel`)
      is refused before launch. The bad-input file must exist, its config must contain every FRAGMENT,
      and its `# expect:` message (the one the bad_input.NAME ctest requires) must name one of
      them. No config in configs/parity/ may contain every FRAGMENT: a parity config that trains the
      feature against its golden means the feature is built.
  <!-- works: FRAGMENT [+ FRAGMENT ...] => NAME[, NAME ...] -->
      The feature works: each NAME is a config configs/parity/NAME.yaml that exists and contains every
      FRAGMENT (so its golden.NAME ctest trains it).
  <!-- count: KEY -->
      Right after a number (digits or a word up to twelve): the number must equal KEY computed from
      the tree (COUNTS below).

Inline code (`...`) is shown, not claimed. A paragraph that says "not built" must carry a `not built` claim, and a number of parity configs,
models or schedules must carry a `count` claim (or the page drops the number): a count typed by hand
goes stale. Prints FILE:LINE: PROBLEM for each claim that does not hold and exits 1 if any.

    python3 tests/docs/check_claims.py            # from the repository root
    python3 tests/docs/check_claims.py --root DIR # another checkout
"""
import argparse
import glob
import os
import re
import subprocess
import sys

CLAIM = re.compile(r"<!--\s*(not built|refused|works)\s*:\s*(.*?)\s*=>\s*(.*?)\s*-->")
COUNT = re.compile(r"(\S+?)\s*<!--\s*count\s*:\s*([a-z0-9_]+)\s*-->")
ANY_MARKER = re.compile(r"<!--.*?-->")
CODE_SPAN = re.compile(r"`[^`]*`")
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
         "twelve"]
# A count of these, typed without a count claim, is a problem.
UNMARKED = re.compile(r"\b(\d+|%s)\s+(?:registered\s+|parity\s+|single-device\s+)?(parity configs|models|schedules)\b"
                      % "|".join(WORDS), re.IGNORECASE)
NOT_BUILT = re.compile(r"not built", re.IGNORECASE)


def documents(root):
    files = [os.path.join(root, "README.md")] if os.path.isfile(os.path.join(root, "README.md")) else []
    return files + sorted(glob.glob(os.path.join(root, "docs", "*.md")))


def paragraphs(path):
    """(first line number, text) of each paragraph outside ``` fences; a fence line ends one."""
    out, lines, start, in_fence = [], [], 0, False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                in_fence = not in_fence
                if lines:
                    out.append((start, " ".join(lines)))
                lines = []
                continue
            if in_fence or not line.strip():
                if lines:
                    out.append((start, " ".join(lines)))
                lines = []
                continue
            if not lines:
                start = number
            lines.append(line.strip())
    if lines:
        out.append((start, " ".join(lines)))
    return out


def config_text(path):
    """A YAML file's text without comment lines (a bad-input file's `# expect:` is not its config)."""
    with open(path, encoding="utf-8") as f:
        return "".join(line for line in f if not line.lstrip().startswith("#"))


def expect_line(path):
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    return first[len("# expect: "):].strip() if first.startswith("# expect: ") else ""


def fragments(text):
    return [f.strip().strip("`") for f in text.split("+") if f.strip()]


class Tree:
    """What the claims are checked against, computed once."""

    def __init__(self, root):
        self.root = root
        self.parity = {os.path.basename(p)[:-5]: config_text(p)
                       for p in sorted(glob.glob(os.path.join(root, "configs", "parity", "*.yaml")))}
        self._matrix = {}

    def matrix(self, slice_only):
        """Plan ids of tools/matrix --list (and --slice)."""
        if slice_only not in self._matrix:
            cmd = [sys.executable, os.path.join(self.root, "tools", "matrix"), "--list"] + (["--slice"] if slice_only else [])
            out = subprocess.run(cmd, cwd=self.root, capture_output=True, text=True, check=True).stdout.split("\n")
            ids = [line.strip() for line in out if line.strip() and not line.strip().endswith(" plans")]
            total = [line for line in out if line.strip().endswith(" plans")]
            if total and int(total[-1].split()[0]) != len(ids):
                raise RuntimeError("tools/matrix --list printed %d ids but says %s" % (len(ids), total[-1]))
            self._matrix[slice_only] = ids
        return self._matrix[slice_only]

    def schedules(self):
        with open(os.path.join(self.root, "parallelisms", "pipeline", "schedule.h"), encoding="utf-8") as f:
            return sorted(set(re.findall(r"\{ScheduleKind::k\w+,\s*\"(\w+)\"\}", f.read())))

    def models(self):
        names = []
        for path in sorted(glob.glob(os.path.join(self.root, "models", "*.cpp"))):
            with open(path, encoding="utf-8") as f:
                names += re.findall(r"ModelDecl<\w+>\(\s*\"(\w+)\"", f.read())
        return names


def moe(ids):
    """The plans of the mixture-of-experts models (the ones with the ep feature)."""
    return [i for i in ids if i.startswith(("moe_llama.", "deepseek_v3.", "qwen3_moe."))]


COUNTS = {
    "parity_configs": lambda t: len(t.parity),
    "bad_inputs": lambda t: len(glob.glob(os.path.join(t.root, "tests", "bad_inputs", "*.yaml"))),
    "registered_models": lambda t: len(t.models()),
    "schedules": lambda t: len(t.schedules()),
    "matrix_models": lambda t: len({i.split(".")[0] for i in t.matrix(False)}),
    "matrix_plans": lambda t: len(t.matrix(False)),
    "matrix_moe_plans": lambda t: len(moe(t.matrix(False))),
    "matrix_moe_no_ep": lambda t: len([i for i in moe(t.matrix(False)) if ".ep2" not in i]),
    "matrix_moe_ep2": lambda t: len([i for i in moe(t.matrix(False)) if ".ep2." in i]),
    "matrix_moe_ep2dp": lambda t: len([i for i in moe(t.matrix(False)) if ".ep2dp." in i]),
    "matrix_moe_ep2dp_replicate": lambda t: len([i for i in moe(t.matrix(False)) if ".ep2dp.rep2." in i]),
    "matrix_ep_plans": lambda t: len([i for i in moe(t.matrix(False)) if ".ep2" in i]),
    "matrix_slice_plans": lambda t: len(t.matrix(True)),
    "matrix_slice_moe_plans": lambda t: len(moe(t.matrix(True))),
    "matrix_slice_moe_no_ep": lambda t: len([i for i in moe(t.matrix(True)) if ".ep2" not in i]),
    "matrix_slice_moe_ep2": lambda t: len([i for i in moe(t.matrix(True)) if ".ep2." in i]),
    "matrix_slice_moe_ep2dp": lambda t: len([i for i in moe(t.matrix(True)) if ".ep2dp." in i]),
}


def number(text):
    text = text.strip("(`*_").lower()
    if text.isdigit():
        return int(text)
    return WORDS.index(text) if text in WORDS else None


def check_claim(tree, kind, feature, evidence):
    """The problems of one claim (empty when it holds)."""
    frags = fragments(feature)
    if not frags:
        return ["a %s claim names no feature" % kind]
    problems = []
    if kind in ("not built", "refused"):
        path = os.path.join(tree.root, evidence.strip("`"))
        if not re.fullmatch(r"tests/bad_inputs/[\w.-]+\.yaml", evidence.strip("`")) or not os.path.isfile(path):
            return ["'%s' is called %s, but %s is no bad-input file (tests/bad_inputs/NAME.yaml)" %
                    (feature, kind, evidence)]
        body, expect = config_text(path), expect_line(path)
        missing = [f for f in frags if f not in body]
        if missing:
            problems.append("%s does not contain %s, so it does not show '%s' refused" %
                            (evidence, ", ".join(missing), feature))
        if not expect:
            problems.append("%s has no '# expect: MESSAGE' first line" % evidence)
        elif not any(f.split(":")[0].strip() in expect for f in frags):
            problems.append("%s's expected message (%s) names none of %s" % (evidence, expect, ", ".join(frags)))
        built = [name for name, text in tree.parity.items() if all(f in text for f in frags)]
        if built:
            problems.append("'%s' is called %s, but configs/parity/%s.yaml trains it against its golden" %
                            (feature, kind, built[0]) + (" (and %d more)" % (len(built) - 1) if len(built) > 1 else ""))
    else:
        names = [n.strip().strip("`") for n in evidence.split(",") if n.strip()]
        if not names:
            problems.append("'%s' is called working but names no parity config" % feature)
        for name in names:
            if name not in tree.parity:
                problems.append("'%s' is called working with configs/parity/%s.yaml, which does not exist" %
                                (feature, name))
            else:
                missing = [f for f in frags if f not in tree.parity[name]]
                if missing:
                    problems.append("configs/parity/%s.yaml does not contain %s, so it does not train '%s'" %
                                    (name, ", ".join(missing), feature))
    return problems


def check(root):
    tree = Tree(root)
    problems, claims, counts = [], 0, 0
    for doc in documents(root):
        rel = os.path.relpath(doc, root)
        for line, text in paragraphs(doc):
            text = CODE_SPAN.sub(lambda m: "`code`" if "<!--" in m.group(0) else m.group(0), text)  # shown, not claimed
            found = CLAIM.findall(text)
            for kind, feature, evidence in found:
                claims += 1
                problems += ["%s:%d: %s" % (rel, line, p) for p in check_claim(tree, kind, feature, evidence)]
            prose = CODE_SPAN.sub("`code`", ANY_MARKER.sub(lambda m: "#counted" if "count:" in m.group(0) else "", text))
            if NOT_BUILT.search(prose) and not any(kind == "not built" for kind, _, _ in found):
                problems.append("%s:%d: a paragraph says 'not built' without a `<!-- not built: FEATURE => "
                                "tests/bad_inputs/NAME.yaml -->` claim" % (rel, line))
            for word, key in COUNT.findall(text):
                counts += 1
                if key not in COUNTS:
                    problems.append("%s:%d: unknown count '%s' (known: %s)" % (rel, line, key, ", ".join(sorted(COUNTS))))
                    continue
                want, got = COUNTS[key](tree), number(word)
                if got != want:
                    problems.append("%s:%d: the page says %s for %s; the tree has %d" % (rel, line, word, key, want))
            for m in UNMARKED.finditer(prose):
                problems.append("%s:%d: '%s' is a count typed by hand; follow the number with <!-- count: KEY --> "
                                "(tests/docs/check_claims.py computes it) or drop it" % (rel, line, m.group(0)))
    for p in problems:
        print(p)
    print("%d claims and %d counts checked, %d problems" % (claims, counts, len(problems)))
    return 1 if problems else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(check(ap.parse_args().root))


if __name__ == "__main__":
    main()
