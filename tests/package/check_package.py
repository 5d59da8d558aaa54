#!/usr/bin/env python3
"""zeroshard as a user's project gets it: `cmake --install`'s tree, the CMake package, zeroshard.pc,
and add_subdirectory, each driving a trainer outside the tree (tests/package/consumer).

Usage: check_package.py CMAKE GENERATOR BUILD_DIR SOURCE_DIR TORCH_DIR TORCH_LIBRARY_DIR CHECK...
  install       `cmake --install BUILD --prefix` into a temporary directory, then moved elsewhere (the
                package must be relocatable). The tree holds exactly include/zeroshard/*.h, the two
                libraries, the three tools, the CMake package and zeroshard.pc; no installed CMake file
                or .pc names the source tree, the build tree or NCCL's headers, and the exported
                include directory is <prefix>/include alone.
  package       (after install) a project with find_package(zeroshard 0.2 CONFIG REQUIRED) configures
                with LibTorch's prefix as a user passes it, builds, and runs at 1 and at 2 ranks under
                the installed zeroshard-run: the 2-rank losses equal the 1-rank run's within 1e-5
                relative (the same global batch; only the order of the gradient sums differs), each of
                the 2 ranks holds half of the 1-rank run's AdamW moments, the headers' and the
                library's versions agree, one libc10 is loaded (the LibTorch zeroshard was built
                against), and the installed zeroshard-ckpt verifies the checkpoint it saved.
                Configured against the other LibTorch on this machine (the wheel's 2.x or Debian's
                1.13), the project fails at configure with a message naming both versions.
  pkgconfig     (after install) every installed header compiles alone with `pkg-config --cflags
                zeroshard`, and the trainer built by the compiler alone with `pkg-config --cflags
                --libs zeroshard` runs at 2 ranks with the package build's losses.
  pkgconfig-trainer  pkgconfig without the headers compiled alone (the other LibTorch's leg does that).
  notoolkit     (with package; a build with CUDA against PyPI's CUDA wheel) the package check, and the
                trainer built with pkg-config's flags, run where no CUDA toolkit is: /usr/local/cuda and
                /usr/local/include's CUDA links hidden (a private mount namespace: needs root), no nvcc
                on PATH. The package needs only the wheel's CUDA libraries.
  deb           (against Debian's LibTorch) `cpack -G DEB` makes zeroshard_<version>_amd64.deb, which
                depends on libtorch-dev of the same release and the -dev packages a trainer needs; dpkg
                installs it (in a private mount namespace, over an overlay of /usr and /var: needs root),
                and the trainer configured with no prefix builds against /usr and runs at 1 and 2 ranks.
  outside       (after install; in a private mount namespace where /usr/local/include's CUDA links are
                hidden: needs root) two trainers written for LibTorch alone (tests/outside: a regression
                over torch's data loader with Adam and clip_grad_norm_, a GAN with two Adam optimizers),
                copied out of the tree; each builds and trains as it is, then tests/outside/sharding.patch
                is applied (its changed lines counted), and the sharded trainers build against the
                installed package and run at 1 and 2 ranks under zeroshard-run (and, against LibTorch
                2.x, at 2 ranks under torchrun): at every step the 2 ranks' mean loss equals the 1-rank
                loss and the global gradient norm the 1-rank one, within 1e-4 relative, and each rank's
                checkpoint file (read with h5py) holds half of the AdamW moments, within one alignment
                block per bucket.
  subdirectory  (in a private mount namespace where /usr/local/include's CUDA links are hidden: needs root;
                the toolkit's headers only in its own directory, as NVIDIA's packages install them)
                the project with SOURCE_DIR added through FetchContent (add_subdirectory underneath):
                zeroshard's tests, examples and benchmarks are not configured, the project's own
                compile line carries none of zeroshard's build settings (no precompiled header, no
                compiler launcher, no -ffp-contract, no -Wextra, no source-tree include path); it
                builds against the zeroshard:: targets and its 2-rank losses equal its 1-rank ones.
"""
import concurrent.futures
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pycheck import check, skip  # noqa: E402

TIMEOUT = 900  # seconds for any one command (a subdirectory build compiles zeroshard)
HERE = os.path.dirname(os.path.abspath(__file__))
CONSUMER = os.path.join(HERE, "consumer")

cmake, generator, build, source, torch_dir, torch_lib = sys.argv[1:7]
checks = sys.argv[7:]
# The checks' trees sit at a fixed place for this build directory, one per check: compiler caches
# key on paths, and a tree at a new temporary path each run compiled everything again (the
# subdirectory's zeroshard build alone took 400 s of a warm CI's time). Outside the source tree: a
# user's project is no part of zeroshard's git work tree (`git apply` there would patch nothing).
work = os.path.join(tempfile.gettempdir(), "zs-package-checks-" + hashlib.sha1(os.path.abspath(build).encode()).hexdigest()[:12],
                    checks[0] if checks[0].endswith("-inside") or checks[0] in ("package-without-toolkit", "deb-installed")
                    else "-".join(checks))
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
prefix = os.path.join(work, "prefix")
# The user's own compiler cache for what the checks compile as a user would (a trainer, each header
# alone): it changes no compile's result, and zeroshard's package must not depend on it.
CCACHE = shutil.which("ccache")
LAUNCHER = [f"-DCMAKE_CXX_COMPILER_LAUNCHER={CCACHE}"] if CCACHE else []


def run(cmd, what, env=None, cwd=None, ok=True):
    start = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=cwd)
    out = p.stdout + p.stderr
    print(f"  {what}: exit {p.returncode}, {time.time() - start:.1f} s", flush=True)
    if ok and p.returncode != 0:
        raise SystemExit(f"{what} failed (exit {p.returncode}): {shlex.join(cmd)}\n{out[-8000:]}")
    return p.returncode, out


def torch_prefix():
    """What a user passes as CMAKE_PREFIX_PATH for this LibTorch: the directory above its Torch/
    (the wheel's torch.utils.cmake_prefix_path); Debian's is found without one."""
    return os.path.dirname(torch_dir) if "site-packages" in torch_dir else ""


def configure(name, *args):
    tree = os.path.join(work, name)
    shutil.rmtree(tree, ignore_errors=True)
    cmd = [cmake, "-S", CONSUMER, "-B", tree, "-G", generator, "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
           *(LAUNCHER if name != "subdirectory" else []), *args]  # the subdirectory check: no launcher of the user's
    return tree, run(cmd, f"configure {name}")[1]


def parse_run(out, what):
    out = re.sub(r"^\[rank0\]: ", "", out, flags=re.M)  # zeroshard-run's prefix of rank 0's lines
    losses = [float(m) for m in re.findall(r"^step \d+ loss (\S+)$", out, re.M)]
    check(len(losses) == 8, lambda: f"{what}: expected 8 step losses, got {len(losses)}:\n{out[-3000:]}")
    info = {"losses": losses}
    m = re.search(r"^version headers (\d+) library (\S+)$", out, re.M)
    check(m, lambda: f"{what}: no version line:\n{out[-3000:]}")
    info["versions"] = (int(m.group(1)), m.group(2))
    info["state_bytes"] = int(re.search(r"^optimizer state bytes (\d+)$", out, re.M).group(1))
    info["c10"] = re.findall(r"^libc10 (\S+)$", out, re.M)
    return info


def moment_bytes(world):
    """The AdamW moments one rank of `world` holds for the trainer's model (Linear 8->512, Linear 512->1,
    one bucket): every parameter starts on a multiple of 64 elements, the bucket is padded to a multiple
    of 64 x world and split evenly; two fp32 moments per element."""
    aligned = sum(-(-n // 64) * 64 for n in (8 * 512, 512, 512, 1))
    padded = -(-aligned // (64 * world)) * 64 * world
    return 2 * 4 * padded // world


def trainer_run(program, nproc, what, run_dir="", launcher=None):
    launcher = launcher or os.path.join(prefix, "bin", "zeroshard-run")
    cmd = [launcher, "--nproc-per-node", str(nproc), "--", program] + ([run_dir] if run_dir else [])
    return parse_run(run(cmd, f"{what} at {nproc} rank(s)")[1], what)


def same_losses(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        check(abs(x - y) <= 1e-5 * abs(y), lambda: f"{what}: step {i} loss {x} vs {y} (more than 1e-5 relative)")


def version_header():
    text = open(os.path.join(source, "include", "zeroshard", "version.h")).read()
    parts = [int(re.search(rf"#define ZEROSHARD_VERSION_{p} (\d+)", text).group(1)) for p in ("MAJOR", "MINOR", "PATCH")]
    return parts[0] * 10000 + parts[1] * 100 + parts[2], ".".join(map(str, parts))


def check_install():
    staged = os.path.join(work, "staged")
    run([cmake, "--install", build, "--prefix", staged], "cmake --install")
    os.rename(staged, prefix)  # relocated: nothing may depend on where it was installed
    files = sorted(os.path.relpath(os.path.join(d, f), prefix) for d, _, fs in os.walk(prefix) for f in fs)
    print("  installed: " + " ".join(files))
    headers = sorted(f for f in os.listdir(os.path.join(source, "include", "zeroshard")) if f.endswith(".h"))
    got = sorted(os.path.basename(f) for f in files if f.startswith("include/"))
    check(got == headers, lambda: f"installed headers {got} != include/zeroshard/ {headers}")
    check(all(f.startswith("include/zeroshard/") for f in files if f.startswith("include/")),
          lambda: f"headers outside include/zeroshard/: {[f for f in files if f.startswith('include/')]}")
    for tool in ("zeroshard-run", "zeroshard-ckpt", "zeroshard-plan"):
        check(f"bin/{tool}" in files, lambda: f"bin/{tool} not installed: {files}")
    libs = [f for f in files if f.endswith(".a")]
    check(sorted(os.path.basename(f) for f in libs) == ["libzeroshard.a", "libzeroshard_checkpoint.a", "libzeroshard_replica.a"],
          lambda: f"installed libraries: {libs}")
    cmake_files = [f for f in files if "/cmake/zeroshard/" in f]
    for name in ("zeroshardConfig.cmake", "zeroshardConfigVersion.cmake", "zeroshardTargets.cmake"):
        check(any(f.endswith("/" + name) for f in cmake_files), lambda: f"no {name} in {cmake_files}")
    pcs = [f for f in files if f.endswith("/pkgconfig/zeroshard.pc")]
    check(len(pcs) == 1, lambda: f"zeroshard.pc: {pcs}")
    nccl_include = re.search(r"^ZS_NCCL_INCLUDE_DIR:PATH=(.*)$", open(os.path.join(build, "CMakeCache.txt")).read(), re.M)
    # (The project's Python environment may live in the source tree: the LibTorch hint may name it.)
    forbidden = [os.path.join(root, d) for root in {source, os.path.realpath(source)}
                 for d in ("src", "include", "cmake", "checkpoint", "examples")] + [build, os.path.realpath(build)]
    if nccl_include and nccl_include.group(1).startswith("/"):
        forbidden.append(nccl_include.group(1))
    for f in cmake_files + pcs:
        text = open(os.path.join(prefix, f)).read()
        for path in forbidden:
            check(path not in text, lambda: f"{f} names {path} (the build machine's source, build or NCCL include tree)")
    targets = "".join(open(os.path.join(prefix, f)).read() for f in cmake_files if "/zeroshardTargets" in f)
    includes = set(re.findall(r'INTERFACE_INCLUDE_DIRECTORIES "([^"]*)"', targets))
    check(includes == {"${_IMPORT_PREFIX}/include"},
          lambda: f"exported include directories {includes}, expected <prefix>/include alone")
    # Every path the exported targets name is inside the prefix or a dependency's target name.
    absolute = sorted(set(re.findall(r'(?<![\w}])/(?:usr|home|work|opt|tmp)[^";\s>]*', targets)))
    check(not absolute, lambda: f"zeroshardTargets*.cmake names absolute paths {absolute}")


def check_package():
    args = [f"-DCMAKE_PREFIX_PATH={prefix};{torch_prefix()}" if torch_prefix() else f"-DCMAKE_PREFIX_PATH={prefix}"]
    tree, _ = configure("package", *args)
    run([cmake, "--build", tree, "-j2"], "build the trainer against the package")
    program = os.path.join(tree, "trainer")
    launcher = open(os.path.join(tree, "launcher.txt")).read()
    check(launcher == os.path.join(prefix, "bin", "zeroshard-run"),
          lambda: f"zeroshard::zeroshard-run is {launcher}, not the installed {prefix}/bin/zeroshard-run")
    one = trainer_run(program, 1, "package trainer")
    two = trainer_run(program, 2, "package trainer", os.path.join(work, "run"))
    same_losses(two["losses"], one["losses"], "2 ranks vs 1 rank")
    check(one["versions"] == version_header(), lambda: f"versions {one['versions']}, version.h says {version_header()}")
    for info, world in ((one, 1), (two, 2)):
        check(info["state_bytes"] == moment_bytes(world),
              lambda: f"at {world} rank(s) each rank holds {info['state_bytes']} bytes of AdamW moments, "
                      f"expected {moment_bytes(world)} (1/{world} of the model's, docs/drop-in.md's layout)")
    real_lib = os.path.realpath(torch_lib)
    for info in (one, two):
        check(len(info["c10"]) == 1 and os.path.dirname(os.path.realpath(info["c10"][0])) == real_lib,
              lambda: f"libc10 loaded: {info['c10']}, expected one, from {real_lib}")
    runs = os.path.join(work, "run")
    run([os.path.join(prefix, "bin", "zeroshard-ckpt"), "verify", runs], "installed zeroshard-ckpt verify")
    print(f"  2-rank losses {two['losses'][0]:.6f} .. {two['losses'][-1]:.6f} equal 1 rank's; "
          f"moments {one['state_bytes']} -> {two['state_bytes']} bytes per rank")

    # Another LibTorch release than the one zeroshard was built against: refused at configure.
    other = other_torch()
    rc, out = configure_expect_failure("other-torch", f"-DCMAKE_PREFIX_PATH={prefix}", f"-DTorch_DIR={other[1]}")
    check(rc != 0 and "built against LibTorch" in out and other[0] in out,
          lambda: f"configuring against LibTorch {other[0]} ({other[1]}) should fail naming both versions:\n{out[-4000:]}")
    print(f"  against LibTorch {other[0]}: refused at configure")
    return one


def configure_expect_failure(name, *args):
    tree = os.path.join(work, name)
    return run([cmake, "-S", CONSUMER, "-B", tree, "-G", generator, *args], f"configure {name}", ok=False)


def other_torch():
    """(version, TorchConfig directory) of the LibTorch this build was not made with."""
    debian = "/usr/lib/x86_64-linux-gnu/cmake/Torch"
    if "site-packages" in torch_dir:
        if not os.path.exists(os.path.join(debian, "TorchConfig.cmake")):
            skip("no second LibTorch (Debian's libtorch-dev) to refuse")
        return "1.13", debian
    try:
        out = subprocess.run([sys.executable, "-c", "import torch, torch.utils; print(torch.__version__); "
                              "print(torch.utils.cmake_prefix_path)"], capture_output=True, text=True, check=True).stdout
    except subprocess.CalledProcessError:
        skip(f"{sys.executable} has no torch: no second LibTorch (the wheel) to refuse")
    version, cmake_prefix = out.split()
    return ".".join(version.split(".")[:2]), os.path.join(cmake_prefix, "Torch")


def pkg_config(*args):
    env = dict(os.environ, PKG_CONFIG_PATH=os.path.dirname(os.path.join(prefix, next(
        f for f in (os.path.relpath(os.path.join(d, x), prefix) for d, _, xs in os.walk(prefix) for x in xs)
        if f.endswith("zeroshard.pc")))))
    return shlex.split(run(["pkg-config", *args, "zeroshard"], "pkg-config " + " ".join(args), env=env)[1])


def check_pkgconfig(reference, headers_alone=True):
    cflags = pkg_config("--cflags")
    libs = pkg_config("--libs")
    if headers_alone:
        check_headers_alone(cflags)
    program = os.path.join(work, "trainer-pc")
    run([*([CCACHE] if CCACHE else []), "g++", *cflags, "-c", os.path.join(CONSUMER, "trainer.cpp"), "-o", program + ".o"],
        "g++ -c with pkg-config's --cflags")
    run(["g++", program + ".o", "-o", program, *libs], "g++ with pkg-config's --libs")
    two = trainer_run(program, 2, "pkg-config trainer")
    same_losses(two["losses"], reference["losses"], "pkg-config build at 2 ranks vs the package build at 1")


def check_headers_alone(cflags):
    headers = sorted(f for f in os.listdir(os.path.join(prefix, "include", "zeroshard")) if f.endswith(".h"))

    alone_dir = os.path.join(work, "headers-alone")
    os.makedirs(alone_dir, exist_ok=True)

    def alone(header):
        unit = os.path.join(alone_dir, header[:-2] + ".cpp")
        with open(unit, "w") as f:
            f.write(f"#include <zeroshard/{header}>\n")
        p = subprocess.run([*([CCACHE] if CCACHE else []), "g++", "-c", *cflags, unit, "-o", unit[:-4] + ".o"],
                           capture_output=True, text=True, timeout=TIMEOUT)
        return header, p.returncode, p.stderr

    start = time.time()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(alone, headers))
    print(f"  {len(headers)} installed headers compiled alone: {time.time() - start:.1f} s", flush=True)
    for header, rc, err in results:
        check(rc == 0, lambda: f"<zeroshard/{header}> does not compile alone with pkg-config's flags:\n{err[-4000:]}")


def check_subdirectory():
    args = [f"-DZEROSHARD_SOURCE_DIR={source}"] + ([f"-DCMAKE_PREFIX_PATH={torch_prefix()}"] if torch_prefix() else [])
    tree, out = configure("subdirectory", *args)
    commands = json.load(open(os.path.join(tree, "compile_commands.json")))
    ours = [c for c in commands if c["file"].endswith("consumer/trainer.cpp")]
    check(len(ours) == 1, lambda: f"compile_commands.json has {len(ours)} entries for trainer.cpp")
    line = ours[0]["command"]
    for leak in ("cmake_pch", "-ffp-contract", os.path.join(source, "src"), "-Wextra"):
        check(leak not in line, lambda: f"the project's own compile line carries zeroshard's '{leak}': {line}")
    # A launcher is no part of compile_commands.json: Ninja's compile rule of each target carries it. zeroshard's
    # (ccache with its sloppiness, when ccache is installed) stays on zeroshard's targets.
    rules = open(os.path.join(tree, "CMakeFiles", "rules.ninja")).read()

    def compile_rule(target):
        m = re.search(rf"^rule CXX_COMPILER__{re.escape(target)}_(?:Release|Debug|RelWithDebInfo|MinSizeRel)?\n"
                      r"(?:  .*\n)*?  command = (.*)$", rules, re.M)
        check(m, lambda: f"no compile rule for the target {target} in {tree}/CMakeFiles/rules.ninja")
        return m.group(1)
    check("ccache" not in compile_rule("trainer"),
          lambda: f"the project's own compile rule carries zeroshard's compiler launcher: {compile_rule('trainer')}")
    if CCACHE:
        check("CCACHE_SLOPPINESS" in compile_rule("zeroshard"),
              lambda: f"zeroshard's compile rule has no launcher of its own: {compile_rule('zeroshard')}")
    _, targets = run([cmake, "--build", tree, "--target", "help"], "list targets")
    for internal in ("zs_tests", "bart_pretrain", "zs_bench", "zs_minimal"):
        check(not re.search(rf"^{internal}\b", targets, re.M), lambda: f"{internal} is configured in a subproject")
    run([cmake, "--build", tree, "-j2", "--target", "trainer", "zeroshard-run"], "build zeroshard as a subdirectory")
    launcher = open(os.path.join(tree, "launcher.txt")).read()  # zeroshard::zeroshard-run, built here
    check(launcher.startswith(tree), lambda: f"zeroshard::zeroshard-run is {launcher}, outside {tree}")
    one = trainer_run(os.path.join(tree, "trainer"), 1, "subdirectory trainer", launcher=launcher)
    two = trainer_run(os.path.join(tree, "trainer"), 2, "subdirectory trainer", launcher=launcher)
    same_losses(two["losses"], one["losses"], "subdirectory build at 2 ranks vs 1 rank")
    check(two["state_bytes"] == moment_bytes(2), lambda: f"2 ranks hold {two['state_bytes']} bytes of moments each")


OUTSIDE = os.path.join(HERE, "..", "outside")
OUTSIDE_SOURCES = ("CMakeLists.txt", "regression.cpp", "gan.cpp")
BART = os.path.join(HERE, "bart")


def outside_steps(out, what):
    """Per step: {rank: (values...)} from every rank's "epoch E step S <name> V ..." lines, as
    zeroshard-run ([rankN]: ) or torchrun --tee 3 ([defaultN]:) prefix them (no prefix: rank 0)."""
    steps = {}
    for line in out.splitlines():
        m = re.match(r"^(?:\[(?:rank|default)(\d+)\]:\s?)?epoch \d+ step (\d+) (.*)$", line)
        if not m:
            continue
        values = tuple(float(v) for v in m.group(3).split()[1::2])
        steps.setdefault(int(m.group(2)), {})[int(m.group(1) or 0)] = values
    check(steps, lambda: f"{what}: no step lines:\n{out[-3000:]}")
    return steps


def same_steps(got, want, world, what, tol=1e-4):
    """got (world ranks) against want (1 rank): the ranks' mean of each loss (equal shares of the
    batch), and values every rank reports alike (the global gradient norm), within `tol` relative."""
    check(sorted(got) == sorted(want), lambda: f"{what}: steps {sorted(got)} vs {sorted(want)}")
    worst = 0.0
    for s in sorted(want):
        check(sorted(got[s]) == list(range(world)), lambda: f"{what}: step {s} printed by ranks {sorted(got[s])}")
        mean = [sum(r[i] for r in got[s].values()) / world for i in range(len(want[s][0]))]
        for i, (x, y) in enumerate(zip(mean, want[s][0])):
            worst = max(worst, abs(x - y) / max(abs(y), 1e-12))
            check(abs(x - y) <= tol * abs(y), lambda: f"{what}: step {s} value {i}: {x} vs {y} at 1 rank")
    return worst


def moments_per_rank(run_dir):
    """(elements of exp_avg in each rank's file, buckets) of the newest checkpoint in run_dir, by h5py."""
    import h5py
    step = os.path.join(run_dir, open(os.path.join(run_dir, "latest")).read().strip())
    manifest = json.load(open(os.path.join(step, "manifest.json")))
    counts = []
    for name in sorted(f for f in os.listdir(step) if f.startswith("rank-")):
        with h5py.File(os.path.join(step, name), "r") as f:
            counts.append(sum(d.size for d in f["exp_avg"].values()) if "exp_avg" in f else 0)
    return counts, len(manifest["groups"])


def check_outside():
    """The two outside trainers: as written, then sharded by their patch (see the docstring)."""
    root = os.path.join(work, "outside")
    original, sharded = os.path.join(root, "original"), os.path.join(root, "sharded")
    for tree in (original, sharded):
        os.makedirs(tree)
        for f in OUTSIDE_SOURCES:
            shutil.copy(os.path.join(OUTSIDE, f), tree)
    patch = os.path.join(OUTSIDE, "sharding.patch")
    run(["git", "apply", "-p1", "--whitespace=nowarn", patch], "git apply sharding.patch", cwd=sharded)
    check("zeroshard" in open(os.path.join(sharded, "CMakeLists.txt")).read(), "git apply sharding.patch changed nothing")
    changed = {}
    for block in open(patch).read().split("diff --git ")[1:]:
        name = block.split()[0][2:]
        lines = block.splitlines()
        changed[name] = (sum(1 for l in lines if l.startswith("+") and not l.startswith("+++")),
                         sum(1 for l in lines if l.startswith("-") and not l.startswith("---")))
    print("  sharding.patch: " + ", ".join(f"{n} +{a} -{r}" for n, (a, r) in sorted(changed.items())))
    # The originals build with find_package(Torch) alone against Debian's LibTorch. Against the CUDA
    # wheel on a machine that also has Debian's libtorch-dev and a CUDA toolkit, LibTorch's own
    # TorchConfig links the CUDA toolkit's NCCL where the wheel's is needed; zeroshard's package
    # config avoids that for the sharded build (zeroshardDependencies.cmake), so the originals are
    # built against Debian's only. ${TORCH_LIBRARIES} also names a libc10 found on the system paths
    # before the wheel's unless the prefix is the torch package itself (torch/, not torch/share/cmake).
    trees = [sharded] if "site-packages" in torch_dir else [original, sharded]
    torch_root = os.path.dirname(os.path.dirname(torch_prefix())) if torch_prefix() else ""
    # The BART trainer too (examples/bart, as a user's project: tests/package/bart), against the
    # installed package alone: the library's own main job uses nothing but what users get.
    bart = os.path.join(root, "bart")
    builds = {}
    for tree in trees + [bart]:
        prefixes = ";".join(p for p in ((prefix if tree != original else ""), torch_root) if p)
        build_dir = tree + "-build"
        source_args = [BART, f"-DBART_SOURCE_DIR={os.path.join(source, 'examples', 'bart')}"] if tree == bart else [tree]
        run([cmake, "-S", *source_args, "-B", build_dir, "-G", generator, "-DCMAKE_BUILD_TYPE=Release", *LAUNCHER] +
            ([f"-DCMAKE_PREFIX_PATH={prefixes}"] if prefixes else []), f"configure {os.path.basename(tree)}")
        builds[tree] = build_dir
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda tree: run([cmake, "--build", builds[tree], "-j1"], f"build {os.path.basename(tree)}"),
                      trees + [bart]))
    _, out = run([os.path.join(builds[bart], "bart_pretrain"), "--help"], "bart_pretrain --help (built outside)")
    check("BART denoising pretraining" in out, lambda: f"bart_pretrain built outside printed:\n{out[-2000:]}")
    print("  examples/bart built against the installed package alone, and runs")

    # As written: each trains (the regression's last epoch's mean loss under half its first's) and
    # saves with torch::save.
    for program, saved in () if original not in builds else (("regression", ["model.pt", "optimizer.pt"]),
                           ("gan", ["generator.pt", "generator-optimizer.pt", "discriminator.pt",
                                    "discriminator-optimizer.pt"])):
        out_dir = os.path.join(root, program + "-original-out")
        os.makedirs(out_dir)
        steps = outside_steps(run([os.path.join(builds[original], program), out_dir], f"{program} as written")[1],
                              f"{program} as written")
        half = len(steps) // 2
        first = sum(steps[s][0][0] for s in sorted(steps)[:half]) / half
        last = sum(steps[s][0][0] for s in sorted(steps)[half:]) / (len(steps) - half)
        if program == "regression":
            check(last < 0.5 * first, lambda: f"regression as written: mean loss {first} then {last}: it does not train")
        for f in saved:
            check(os.path.exists(os.path.join(out_dir, f)), lambda: f"{program} as written saved no {f}")

    launchers = [("zeroshard-run", [os.path.join(prefix, "bin", "zeroshard-run"), "--nproc-per-node"])]
    if "site-packages" in torch_dir:  # torchrun is the 2.x wheel's (CMakeLists.txt: torchrun_* tests)
        launchers.append(("torchrun", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--no-python",
                                       "--tee", "3", "--nproc-per-node"]))
    for program, checkpoints in (("regression", [""]), ("gan", ["generator", "discriminator"])):
        exe = os.path.join(builds[sharded], program)
        runs = {}
        for name, launcher in launchers:
            for world in ((1, 2) if name == "zeroshard-run" else (2,)):
                out_dir = os.path.join(root, f"{program}-{name}-{world}")
                os.makedirs(out_dir)
                what = f"sharded {program} under {name} at {world} rank(s)"
                runs[(name, world)] = (outside_steps(run(launcher + [str(world), exe, out_dir], what)[1], what), out_dir)
        one = runs[("zeroshard-run", 1)][0]
        for key, (steps, out_dir) in runs.items():
            if key[1] == 1:
                continue
            worst = same_steps(steps, {s: {0: one[s][0]} for s in one}, key[1], f"sharded {program} under {key[0]}")
            for ckpt in checkpoints:
                counts, buckets = moments_per_rank(os.path.join(out_dir, ckpt))
                total = moments_per_rank(os.path.join(runs[("zeroshard-run", 1)][1], ckpt))[0]
                check(len(counts) == 2 and sum(counts) == total[0] and
                      all(abs(c - total[0] / 2) <= 64 * buckets for c in counts),
                      lambda: f"{program} {ckpt}: the ranks hold {counts} AdamW moment elements of {total[0]}, "
                              f"not half each (within 64 per bucket, {buckets} buckets)")
                print(f"  {program}{' ' + ckpt if ckpt else ''}: each of 2 ranks holds {counts} of {total[0]} "
                      f"moment elements")
            print(f"  {program} under {key[0]} at 2 ranks: {len(steps)} steps, each step's printed values (the "
                  f"ranks' mean) within {worst:.2g} of 1 rank's")


def in_mount_namespace(step, arg, what):
    """Runs this script's `step` (with `arg`) again in a private mount namespace, where its mounts
    end with it; its output is shown indented. Needs root."""
    if os.geteuid() != 0:
        skip(f"{what} runs in a private mount namespace, which needs root")
    rc, out = run(["unshare", "--mount", "--propagation", "private", sys.executable, os.path.abspath(__file__),
                   *sys.argv[1:7], step, arg], f"{what}, in a mount namespace", ok=False)
    print("\n".join("    " + line for line in out.splitlines()))
    check(rc == 0, f"{what} failed in the mount namespace (above)")
    return out


def check_package_without_toolkit():
    """check_package() where no CUDA toolkit is (a build with CUDA against PyPI's CUDA wheel): from a
    private mount namespace in which /usr/local/cuda's directory is an empty tmpfs and no nvcc is on
    PATH. Returns what check_package() returns (its losses)."""
    out = in_mount_namespace("package-without-toolkit", prefix, "the package check with the CUDA toolkit hidden")
    m = re.search(r"^reference (.*)$", out, re.M)
    check(m, "the package check in the mount namespace printed no reference losses")
    return {"losses": json.loads(m.group(1))}


def hide_cuda_headers_in_default_paths():
    """In a mount namespace: an empty /usr/local/include where it holds links into a CUDA toolkit (as the
    build machines link every CUDA header there), so that a compile finds CUDA's headers only where
    the build says. A box with NVIDIA's toolkit has them in /usr/local/cuda/include alone."""
    d = "/usr/local/include"
    if os.path.isdir(d) and any("cuda" in os.path.realpath(os.path.join(d, f)) for f in os.listdir(d)):
        run(["mount", "-t", "tmpfs", "zs-package-include", d], f"hide {d}")
    check(not os.path.exists("/usr/local/include/cuda_runtime.h"), "cuda_runtime.h is still in /usr/local/include")


def check_subdirectory_without_default_cuda_headers():
    """check_subdirectory() in a private mount namespace where /usr/local/include is empty: a box with
    NVIDIA's toolkit in /usr/local/cuda and nothing in the compiler's default paths."""
    if os.geteuid() != 0:
        skip("the subdirectory check runs in a private mount namespace, which needs root")
    in_mount_namespace("subdirectory-inside", "-", "the subdirectory check with /usr/local/include's CUDA links hidden")


def check_package_without_toolkit_inside(installed):
    global prefix
    prefix = installed
    hide_cuda_headers_in_default_paths()
    toolkit = os.path.realpath("/usr/local/cuda")
    if os.path.isdir(toolkit):
        run(["mount", "-t", "tmpfs", "zs-package", toolkit], f"hide {toolkit}")
    path = [d for d in os.environ.get("PATH", "").split(":") if d and not os.path.exists(os.path.join(d, "nvcc"))]
    os.environ["PATH"] = ":".join(path)
    for var in ("CUDACXX", "CUDA_HOME", "CUDA_PATH", "CUDAToolkit_ROOT"):
        os.environ.pop(var, None)
    check(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"), "nvcc is still reachable")
    print("  no CUDA toolkit, no nvcc: the package check configures against the CUDA wheel", flush=True)
    reference = check_package()
    print("  the same, with pkg-config's flags:", flush=True)
    check_pkgconfig(reference, headers_alone=False)
    print("reference " + json.dumps(reference["losses"]), flush=True)


def check_deb():
    """The .deb of this build (cpack -G DEB), installed with dpkg into this machine's root as seen
    from a private mount namespace (an overlay on /usr and /var: the real ones do not change)."""
    out_dir = os.path.join(work, "deb")
    run([os.path.join(os.path.dirname(cmake), "cpack"), "-G", "DEB", "-B", out_dir], "cpack -G DEB", cwd=build)
    _, version = version_header()
    deb = os.path.join(out_dir, f"zeroshard_{version}_amd64.deb")
    check(os.path.exists(deb), lambda: f"no {deb}: {os.listdir(out_dir)}")
    depends = run(["dpkg-deb", "-f", deb, "Depends"], "dpkg-deb -f Depends")[1]
    for package in ("libtorch-dev", "libspdlog-dev", "libhdf5-dev", "libxxhash-dev"):
        check(package in depends, lambda: f"the .deb does not depend on {package}: {depends}")
    contents = run(["dpkg-deb", "-c", deb], "dpkg-deb -c")[1]
    for path in ["./usr/bin/zeroshard-run", "./usr/lib/libzeroshard.a", "./usr/lib/cmake/zeroshard/zeroshardConfig.cmake",
                 "./usr/include/zeroshard/version.h", "./usr/lib/pkgconfig/zeroshard.pc"]:
        check(path in contents, lambda: f"the .deb has no {path}:\n{contents}")
    in_mount_namespace("deb-installed", deb, "dpkg -i and the trainer")


def check_deb_installed(deb):
    """Inside the namespace: overlays on /usr and /var, dpkg -i, then the trainer against /usr."""
    layers = os.path.join(work, "layers")
    os.makedirs(layers)
    run(["mount", "-t", "tmpfs", "zs-package", layers], "mount a tmpfs")
    for top in ("/usr", "/var"):
        upper, lower_work = os.path.join(layers, top[1:]), os.path.join(layers, top[1:] + "-work")
        os.makedirs(upper)
        os.makedirs(lower_work)
        run(["mount", "-t", "overlay", "zs-package", "-o", f"lowerdir={top},upperdir={upper},workdir={lower_work}", top],
            f"overlay on {top}")
    check(not os.path.exists("/usr/lib/cmake/zeroshard"), "zeroshard is installed in /usr already")
    run(["dpkg", "-i", deb], "dpkg -i (its dependencies checked against this machine's packages)")
    status = run(["dpkg-query", "-W", "-f", "${Status} ${Version}", "zeroshard"], "dpkg-query")[1]
    check(status.startswith("install ok installed"), lambda: f"dpkg says: {status}")
    tree, _ = configure("deb")
    run([cmake, "--build", tree, "-j2"], "build the trainer against the installed .deb")
    launcher = "/usr/bin/zeroshard-run"
    one = trainer_run(os.path.join(tree, "trainer"), 1, "deb trainer", launcher=launcher)
    two = trainer_run(os.path.join(tree, "trainer"), 2, "deb trainer", launcher=launcher)
    same_losses(two["losses"], one["losses"], ".deb build at 2 ranks vs 1 rank")
    check(two["state_bytes"] == moment_bytes(2), lambda: f"2 ranks hold {two['state_bytes']} bytes of moments each")
    print(f"  installed {status}; the trainer built against /usr runs at 1 and 2 ranks")


try:
    reference = None
    if checks[:1] == ["deb-installed"]:
        check_deb_installed(checks[1])
        checks = []
    elif checks[:1] == ["package-without-toolkit"]:
        check_package_without_toolkit_inside(checks[1])
        checks = []
    elif checks[:1] == ["subdirectory-inside"]:
        hide_cuda_headers_in_default_paths()
        check_subdirectory()
        checks = []
    elif checks[:1] == ["outside-inside"]:
        prefix = checks[1]
        hide_cuda_headers_in_default_paths()
        check_outside()
        checks = []
    for name in checks:
        print(f"{name}:", flush=True)
        if name == "install":
            check_install()
        elif name == "package":
            reference = check_package_without_toolkit() if "notoolkit" in checks else check_package()
        elif name == "pkgconfig":
            check_pkgconfig(reference)
        elif name == "pkgconfig-trainer":
            check_pkgconfig(reference, headers_alone=False)
        elif name == "subdirectory":
            check_subdirectory_without_default_cuda_headers()
        elif name == "outside":
            if os.geteuid() != 0:
                skip("the outside trainers build in a private mount namespace, which needs root")
            in_mount_namespace("outside-inside", prefix, "the outside trainers with /usr/local/include's CUDA links hidden")
        elif name == "deb":
            check_deb()
        elif name == "notoolkit":
            check("package" in checks, "notoolkit is how the package check runs: give both")
            print("  the package check above ran with no CUDA toolkit")
        else:
            raise SystemExit(f"unknown check {name}")
    print("ok")
finally:
    shutil.rmtree(work, ignore_errors=True)
