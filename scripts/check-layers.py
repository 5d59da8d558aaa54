#!/usr/bin/env python3
"""check-layers.py [ROOT]: every quoted #include in the library, its public
headers and the BART trainer runs down the layers (docs/architecture.md), never
up. Prints each include that runs up or sideways, with the file and line, and
exits 1 when there is one; 0 when there is none.

A folder's row lists what its files may include besides their own folder; a
source folder that has no row is an error too (a new folder says where it
stands). Includes in <> (system, LibTorch, third-party) are not checked.
"""
import pathlib
import re
import sys

LOWEST = ["zeroshard", "compat"]
RUNTIME = LOWEST + ["runtime"]
BELOW_SHARD = RUNTIME + ["comm", "optim"]
SHARD_CORE = BELOW_SHARD + ["shard/core"]
SHARD_BACKWARD = SHARD_CORE + ["shard/backward"]
SHARD_OPTIMIZER = SHARD_BACKWARD + ["shard/optimizer"]
FRONT_ENDS = ["shard/zero12", "shard/zero3"]

# folder -> the include prefixes (a path's first folders) its files may use
ALLOWED = {
    "include/zeroshard": ["zeroshard"],
    "src/compat": LOWEST,
    "src/runtime": RUNTIME,
    "src/runtime/launcher": RUNTIME,
    "src/comm": RUNTIME + ["comm"],
    "src/comm/nccl": RUNTIME + ["comm"],
    "src/optim": RUNTIME + ["optim"],
    "src/optim/cuda": RUNTIME + ["optim"],
    "src/shard/core": SHARD_CORE,
    "src/shard/backward": SHARD_BACKWARD,
    "src/shard/optimizer": SHARD_OPTIMIZER,
    "src/shard/zero12": SHARD_OPTIMIZER + ["shard/zero12"],
    "src/shard/zero3": SHARD_OPTIMIZER + ["shard/zero3"],
    "src/pipeline": SHARD_OPTIMIZER + FRONT_ENDS + ["pipeline"],
    "src/data": ["zeroshard", "data"],
    "src/plan": ["zeroshard", "plan"],
    "src/replica": SHARD_OPTIMIZER + FRONT_ENDS + ["replica"],
    "checkpoint": RUNTIME + ["comm"],
    "checkpoint/tools": RUNTIME + ["comm", "tools"],
}
# Folders whose files include another folder's files by bare name (its include path).
BARE = {"checkpoint/tools": ["checkpoint"], "src/replica": ["checkpoint"]}
# The BART trainer stands on the installed package alone: the public headers,
# and its own folders (model and tokenizer below data, data below train, the
# command line on top; io is shared by all).
BART = {
    "io": [],
    "model": ["io"],
    "tokenizer": ["io"],
    "data": ["io", "tokenizer"],
    "train": ["io", "model", "tokenizer", "data", "train"],
    "cli": ["io", "model", "tokenizer", "data", "train"],
}
SOURCE = (".h", ".cpp", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def prefix_of(path, known):
    """The longest of `known` that the include path starts with (a folder), or None."""
    best = None
    for k in known:
        if path.startswith(k + "/") and (best is None or len(k) > len(best)):
            best = k
    return best


def check_file(root, f, folder, allowed, problems):
    for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
        m = INCLUDE.match(line)
        if not m:
            continue
        inc = m.group(1)
        if "/" not in inc:  # a file beside it
            homes = [folder] + BARE.get(folder, [])
            if not any((root / h / inc).exists() for h in homes):
                problems.append(f"{f.relative_to(root)}:{n}: \"{inc}\" is not a file of {' or '.join(homes)}/")
            continue
        mine = folder if not folder.startswith("src/") else folder[len("src/"):]
        pre = prefix_of(inc, allowed + [mine])
        if pre is None:
            problems.append(f"{f.relative_to(root)}:{n}: \"{inc}\" runs up or sideways: {folder}/ may include "
                            f"its own files and {', '.join(allowed)} (docs/architecture.md)")


def check(root):
    root = pathlib.Path(root)
    problems = []
    for top in ["include", "src", "checkpoint"]:
        for f in sorted((root / top).rglob("*")):
            if f.suffix not in SOURCE:
                continue
            folder = str(f.parent.relative_to(root))
            if folder not in ALLOWED:
                problems.append(f"{f.relative_to(root)}: its folder {folder}/ has no row in scripts/check-layers.py; "
                                "add one saying what it may include")
                continue
            check_file(root, f, folder, ALLOWED[folder], problems)
    bart = root / "examples" / "bart"
    for f in sorted(bart.rglob("*")):
        if f.suffix not in SOURCE:
            continue
        sub = str(f.parent.relative_to(bart))
        if sub not in BART:
            problems.append(f"{f.relative_to(root)}: examples/bart/{sub}/ has no row in scripts/check-layers.py")
            continue
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            inc = m.group(1)
            first = inc.split("/")[0]
            ok = inc.startswith("zeroshard/") or ("/" in inc and first in BART[sub] + [sub] and (bart / inc).exists())
            if not ok:
                problems.append(f"{f.relative_to(root)}:{n}: \"{inc}\" is not a public header nor a file of the "
                                f"folders examples/bart/{sub}/ stands on ({', '.join(BART[sub] + [sub])})")
    return problems


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent
    problems = check(root)
    for p in problems:
        print(p)
    if problems:
        print(f"check-layers: {len(problems)} include(s) against the layers")
        return 1
    print("check-layers: every include runs down the layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
