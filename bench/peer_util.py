"""What the PyTorch peers of the benchmarks share (bench/zero_vs_ddp.py,
bench/zero3_bench.py): counting the bytes their collectives send, the loopback
device's bytes as a cross-check, and peak RSS read as zeroshard reads it.
"""
import collections

import torch
import torch.distributed  # noqa: F401  (registers the c10d ops the counter matches)
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


class CommCounter(TorchDispatchMode):
    """Bytes this rank sends in the collectives it issues while active.

    How: every c10d collective goes through the dispatcher as a c10d op
    (c10d::allreduce_, c10d::_allgather_base_, ...), including the ones DDP's
    C++ reducer starts from backward, so a dispatch mode sees each one with its
    tensors (torch.distributed's CommDebugMode works the same way, but counts
    calls, not bytes). Each op's tensor bytes S become the payload bytes one rank
    sends under Gloo's algorithms, which were measured on this torch (loopback
    interface counters and per-socket TCP counters around single collectives,
    2 to 4 ranks):
      all_reduce                  ring: 2(n-1)/n * S per rank
      all_gather (S = output)     ring: (n-1)/n * S per rank
      reduce_scatter (S = input)  2(n-1)/n * S per rank: Gloo reduces the whole
                                  input like an all_reduce and keeps its slice,
                                  twice the (n-1)/n * S of a true reduce-scatter
      broadcast                   binomial tree: (n-1) * S in all, so (n-1)/n * S
                                  per rank on average (the root and inner nodes of
                                  the tree send more, the leaves nothing)
    That is zeroshard's convention (CommStats::bytes_sent: payload only, no
    headers), so the two columns compare. It approximates the wire: TCP/IP and
    Gloo headers (well under 1% at these sizes) and the rendezvous store are not
    counted; the "wire check" line prints what the loopback device carried.
    The dispatch mode costs Python time per op, so only an extra, untimed step
    runs under it; every step issues the same collectives.
    """

    def __init__(self, world):
        super().__init__()
        self.n = world
        self.bytes = 0.0
        self.calls = collections.Counter()

    @staticmethod
    def _nbytes(x):
        if torch.is_tensor(x):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(CommCounter._nbytes(y) for y in x)
        return 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            n = self.n
            self.calls[name] += 1
            if name in ("allreduce_", "allreduce_coalesced_"):
                self.bytes += 2 * (n - 1) / n * self._nbytes(args[0])
            elif name in ("_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_", "allgather_coalesced_"):
                self.bytes += (n - 1) * self._nbytes(args[1])  # inputs: (n-1)/n of the output
            elif name in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
                self.bytes += 2 * (n - 1) / n * self._nbytes(args[1])
            elif name == "broadcast_":
                self.bytes += (n - 1) / n * self._nbytes(args[0])
            elif name == "send":
                self.bytes += self._nbytes(args[0])
            elif name not in ("barrier", "recv_", "recv_any_source_", "monitored_barrier_"):
                self.calls["uncounted " + name] += 1
        return func(*args, **(kwargs or {}))


def loopback_tx_bytes():
    """Bytes the loopback device has sent (every process on this host)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    return 0


def peak_rss_mib():
    """VmHWM, as zeroshard::peak_rss_bytes() reads it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def local_bytes(t):
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()
