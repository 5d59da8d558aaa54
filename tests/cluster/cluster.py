"""A cluster of hosts for the multi-host tests: scripts/cluster.sh's network-namespace hosts, made on entry
and removed on exit (also after a failed check), with jobs started on them.

    with Cluster(number, hosts) as c:          # exits 77 (ctest: skipped) where hosts cannot be made
        jobs = [c.start(i, [...]) for i in range(hosts)]
        outs = c.wait(jobs, timeout)           # every job's exit code and output; raises on a timeout

A leftover cluster of the same number (a run killed by ctest's timeout) is removed by the next `up`.
"""
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pycheck import SKIP, skip  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "cluster.sh")


def cluster_sh(*args, capture=True):
    p = subprocess.run([SCRIPT, *map(str, args)], capture_output=capture, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"scripts/cluster.sh {' '.join(map(str, args))} failed (exit {p.returncode}): "
                           f"{p.stderr if capture else ''}")
    return p.stdout.strip() if capture else ""


def skip_unless_possible():
    """Exits 77 with the reason printed (ctest shows the test as skipped) where hosts cannot be made; fails
    instead under ZS_NO_SKIP=1 (pycheck.skip)."""
    p = subprocess.run([SCRIPT, "can"], capture_output=True, text=True)
    if p.returncode == SKIP:
        skip(f"{p.stderr.strip()}; the multi-host tests need root on Linux")
    if p.returncode != 0:
        raise RuntimeError(f"scripts/cluster.sh can failed (exit {p.returncode}): {p.stderr}")


class Job:
    """A command running on one host; its output (stdout and stderr) goes to a file."""

    def __init__(self, host, cmd, proc, log_path):
        self.host, self.cmd, self.proc, self.log_path = host, cmd, proc, log_path

    def output(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()


class Cluster:
    def __init__(self, number, hosts):
        self.number, self.hosts = number, hosts
        self.jobs = []
        self.logs = tempfile.mkdtemp(prefix=f"zs-cluster{number}-")

    def __enter__(self):
        skip_unless_possible()
        cluster_sh("up", self.number, self.hosts)
        print(f"cluster {self.number}: {self.hosts} hosts, " +
              ", ".join(f"{self.name(i)} {self.addr(i)}" for i in range(self.hosts)), flush=True)
        return self

    def __exit__(self, *exc):
        for j in self.jobs:
            if j.proc.poll() is None:
                j.proc.kill()
        cluster_sh("down", self.number)
        for j in self.jobs:
            j.proc.wait()
        return False

    def addr(self, i, v6=False):
        return cluster_sh("addr", self.number, i, *(["-6"] if v6 else []))

    def name(self, i):
        return cluster_sh("name", self.number, i)

    def start(self, i, cmd, disks=(), env=None):
        """Starts `cmd` on host i; `disks` are (directory, path) pairs mounted for it alone."""
        log_path = os.path.join(self.logs, f"job{len(self.jobs)}-host{i}.log")
        mounts = [a for d, p in disks for a in ("--disk", f"{d}:{p}")]
        with open(log_path, "w") as log:
            proc = subprocess.Popen([SCRIPT, "exec", str(self.number), str(i), *mounts, "--", *map(str, cmd)],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        job = Job(i, cmd, proc, log_path)
        self.jobs.append(job)
        return job

    def wait(self, jobs, timeout):
        """Waits for every job; returns [(exit code, output)]. A job still running after `timeout` seconds
        fails the check with every job's output."""
        deadline = time.monotonic() + timeout
        for j in jobs:
            try:
                j.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"host {j.host}'s job ran past {timeout} s: {' '.join(map(str, j.cmd))}\n" +
                                     self.outputs(jobs))
        return [(j.proc.returncode, j.output()) for j in jobs]

    @staticmethod
    def outputs(jobs, tail=4000):
        return "\n".join(f"--- host {j.host} (exit {j.proc.poll()}): {' '.join(map(str, j.cmd))}\n{j.output()[-tail:]}"
                         for j in jobs)
