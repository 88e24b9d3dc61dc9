#!/usr/bin/env python3
"""Puts each bug of catalogue.toml back, one at a time, in a scratch copy
of the workspace, sweeps its scenarios on both engines, and reports how
many seeds fail on each (the proof that the checker states the rule the
bug breaks, on turmoil and on madsim).

    python3 sim/bugs/reintroduce.py [--seeds 0..30] [--only SUBSTRING[|...]]
        [--engines turmoil,madsim] [--work DIR] [--out FILE.md]

The scratch copy is a git worktree of HEAD under --work (default
target/bugs), with build directories of its own, so the checkout you work
in is never touched; the first bug pays for a full build of each engine,
the others rebuild the edited crates only. Exit status 1 if any bug fails
no seed on some engine, or an edit no longer applies.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run(cmd, cwd, env=None, capture=True):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(cmd, cwd=cwd, env=e, text=True,
                          capture_output=capture)


def worktree(work):
    tree = os.path.join(work, "tree")
    if os.path.isdir(tree):
        run(["git", "worktree", "remove", "--force", tree], ROOT)
        shutil.rmtree(tree, ignore_errors=True)
    os.makedirs(work, exist_ok=True)
    r = run(["git", "worktree", "add", "--detach", tree, "HEAD"], ROOT)
    if r.returncode != 0:
        sys.exit(f"cannot make a worktree: {r.stderr}")
    return tree


def build(tree, target, engine):
    env = {"RUSTFLAGS": "--cfg madsim"} if engine == "madsim" else {"RUSTFLAGS": ""}
    t = os.path.join(target, engine)
    r = run(["cargo", "build", "--release", "-p", "sim", "--bin", "sim",
             "--target-dir", t], tree, env)
    if r.returncode != 0:
        return None, r.stderr[-3000:]
    return os.path.join(t, "release", "sim"), None


def sweep(binary, tree, scenarios, seeds):
    r = run([binary, "sweep", *scenarios, "--seeds", seeds, "--jobs", "2"], tree)
    failing = {}
    broken = {}
    section = None
    for line in r.stdout.splitlines():
        if line.startswith("scenario "):
            section = "scenarios"
            continue
        if line.startswith("invariant broken"):
            section = "invariants"
            continue
        if not line.strip():
            section = None
            continue
        parts = line.split()
        if section == "scenarios" and len(parts) >= 3 and parts[0] in scenarios:
            failing[parts[0]] = (int(parts[2]), int(parts[1]))
        elif section == "invariants" and len(parts) == 3:
            broken[parts[0]] = int(parts[1])
    return failing, broken


def apply(tree, bug):
    originals = {}
    for edit in bug["edit"]:
        path = os.path.join(tree, edit["file"])
        text = originals.get(path) or open(path).read()
        originals.setdefault(path, text)
        current = open(path).read()
        n = current.count(edit["old"])
        if n != 1:
            return originals, f"{edit['file']}: the edit's old text occurs {n} times"
        open(path, "w").write(current.replace(edit["old"], edit["new"]))
    return originals, None


def restore(originals):
    for path, text in originals.items():
        open(path, "w").write(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0..30")
    ap.add_argument("--only", default=None)
    ap.add_argument("--engines", default="turmoil,madsim")
    ap.add_argument("--work", default=os.path.join(ROOT, "target", "bugs"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    engines = a.engines.split(",")
    catalogue = tomllib.load(open(os.path.join(ROOT, "sim", "bugs", "catalogue.toml"), "rb"))
    only = a.only.split("|") if a.only else None
    bugs = [b for b in catalogue["bug"] if not only or any(o in b["name"] for o in only)]
    tree = worktree(a.work)
    target = os.path.join(a.work, "build")
    rows = []
    ok = True
    started = time.time()
    try:
        for i, bug in enumerate(bugs, 1):
            print(f"[{i}/{len(bugs)}] {bug['name']}", flush=True)
            originals, problem = apply(tree, bug)
            result = {"bug": bug["name"], "rule": bug["rule"], "engines": {}}
            try:
                if problem:
                    result["error"] = problem
                    ok = False
                    print(f"  {problem}", flush=True)
                    rows.append(result)
                    continue
                for engine in engines:
                    binary, err = build(tree, target, engine)
                    if binary is None:
                        result["engines"][engine] = {"error": "build failed: " + err}
                        ok = False
                        print(f"  {engine}: build failed\n{err}", flush=True)
                        continue
                    failing, broken = sweep(binary, tree, bug["scenarios"], a.seeds)
                    total = sum(f for f, _ in failing.values())
                    result["engines"][engine] = {"failing": failing, "broken": broken}
                    if total == 0:
                        ok = False
                    line = ", ".join(f"{s} {f}/{n}" for s, (f, n) in failing.items())
                    print(f"  {engine}: {line}; broken: {broken}", flush=True)
            finally:
                restore(originals)
            rows.append(result)
    finally:
        run(["git", "worktree", "remove", "--force", tree], ROOT)
    md = ["| bug | rule | " + " | ".join(engines) + " |",
          "|---|---|" + "---|" * len(engines)]
    for r in rows:
        cells = []
        for engine in engines:
            e = r["engines"].get(engine)
            if "error" in r:
                cells.append(r["error"])
            elif e is None or "error" in e:
                cells.append("build failed")
            else:
                cells.append(", ".join(f"{s} {f}/{n}" for s, (f, n) in e["failing"].items()))
        md.append(f"| {r['bug']} | `{r['rule']}` | " + " | ".join(cells) + " |")
    report = "\n".join(md)
    print(f"\n{report}\n\n{len(rows)} bugs in {time.time() - started:.0f} s, seeds {a.seeds}")
    if a.out:
        open(a.out, "w").write(report + "\n")
        open(re.sub(r"\.md$", "", a.out) + ".json", "w").write(json.dumps(rows, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
