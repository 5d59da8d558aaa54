#!/usr/bin/env python3
"""layers_test.py ROOT: scripts/check-layers.py passes on the tree, and fails,
naming the file, line and include, on a copy of the tree given an include that
runs up a layer (the library, and the BART trainer's folders)."""
import pathlib
import shutil
import subprocess
import sys
import tempfile

root = pathlib.Path(sys.argv[1]).resolve()
script = root / "scripts" / "check-layers.py"


def run(tree):
    r = subprocess.run([sys.executable, str(script), str(tree)], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


code, out = run(root)
assert code == 0, f"check-layers fails on the tree:\n{out}"

with tempfile.TemporaryDirectory() as tmp:
    copy = pathlib.Path(tmp)
    for part in ["include", "src", "checkpoint", "examples"]:
        shutil.copytree(root / part, copy / part)
    upward = [
        ("src/comm/work.cpp", '#include "shard/zero3/unit.h"'),            # comm includes the sharding
        ("src/shard/core/shard_group.cpp", '#include "shard/zero12/sharded_adamw_impl.h"'),  # core, a front-end
        ("src/shard/zero12/grad_reduction.cpp", '#include "shard/zero3/unit.h"'),  # one front-end, the other
        ("include/zeroshard/comm.h", '#include "comm/work.h"'),             # a public header, the library
        ("examples/bart/model/bart_model.cpp", '#include "train/run.h"'),  # the model, the training run
        ("examples/bart/data/prepare.cpp", '#include "comm/work.h"'),      # the trainer, the library's insides
    ]
    for path, line in upward:
        f = copy / path
        f.write_text(line + "\n" + f.read_text())
    (copy / "src" / "newfolder").mkdir()
    (copy / "src" / "newfolder" / "x.cpp").write_text('#include "zeroshard/comm.h"\n')
    code, out = run(copy)
    assert code == 1, f"check-layers passed a tree with upward includes:\n{out}"
    for path, line in upward:
        include = line.split('"')[1]
        assert f"{path}:1: \"{include}\"" in out, f"not named: {path} including {include}\n{out}"
    assert "src/newfolder/x.cpp: its folder src/newfolder/ has no row" in out, out
    assert out.count("\n") == len(upward) + 2, f"more than the injected includes reported:\n{out}"
print(f"layers: the tree passes; {len(upward)} upward includes and an unplaced folder are each named")
