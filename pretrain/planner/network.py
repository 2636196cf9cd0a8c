"""How long a collective takes: an alpha-beta model of NCCL's ring on H100/H200 nodes.

A ring collective over n ranks moves, per rank, 2(n-1)/n of the buffer for an all-reduce and
(n-1)/n of it (the whole gathered or scattered buffer) for a reduce-scatter or an all-gather,
in 2(n-1) or (n-1) steps; a reduce to one rank (NCCL's pipelined chain) the whole buffer once,
in n-1 steps (nccl-tests' doc/PERFORMANCE.md derives its bus bandwidth from the same factors:
1 for reduce). So

    t = steps x alpha + factor x bytes / bandwidth

Within a node the ring runs over NVLink. Across nodes NCCL's rings are rail-aligned: each node
has one NIC per GPU (DGX/HGX H100 and H200: 8 x 400 Gb/s ConnectX-7) and its channels leave
the node through all of them at once, so a step's bytes go through NVLink and through the
node's g NICs together, and the bandwidth is the smaller of the two: min(B_nvlink, g x B_nic).
That reproduces the published multi-node figures: 8 x ~47 GB/s = 376 GB/s against NVLink's
370 GB/s, and nccl-tests measure 330-380 GB/s bus bandwidth for all-reduce on 2-4 DGX H100
nodes. A ring step that crosses a node costs the network's alpha.

Every default is a published measurement, cited in docs/scaling.md ("The time model");
`Fabric` takes a user's own (tools/plan.py --nvlink-gbs, --nic-gbs, --gpus-per-node).
Not modelled: NVLink SHARP (NVLS, up to 480 GB/s busbw for all-reduce in a node), tree
algorithms for small messages, congestion at thousands of GPUs (NVIDIA's NVLSTree chart falls
from ~350 to ~300 GB/s at 1 GB between 32 and 8K GPUs), and gloo's own algorithms on CPU (its
alpha and beta are measured, `tools/plan.py --check-comms`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pretrain.config import ConfigError

GB = 1e9

ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = "all_reduce", "reduce_scatter", "all_gather"
REDUCE = "reduce"
# DeepSpeed's names (its comms logger's) -> the ring algorithm each runs
KINDS = {
    "all_reduce": ALL_REDUCE,
    "reduce_scatter": REDUCE_SCATTER,
    "reduce_scatter_tensor": REDUCE_SCATTER,
    "all_gather": ALL_GATHER,
    "all_gather_into_tensor": ALL_GATHER,
    "reduce": REDUCE,  # ZeRO 1/2 with use_multi_rank_bucket_allreduce: false
}


@dataclass(frozen=True)
class Fabric:
    """The links of a cluster, per GPU and per direction."""

    name: str
    gpus_per_node: int
    nvlink_bandwidth: float  # bytes/s a ring collective reaches within a node (bus bandwidth)
    nic_bandwidth: float  # bytes/s of one GPU's NIC as NCCL reaches it
    nvlink_alpha: float  # seconds per ring step within a node
    nic_alpha: float  # seconds per ring step that crosses nodes

    def bandwidth(self, n: int) -> float:
        """The ring's bandwidth on n ranks: NVLink's in a node; across nodes the smaller of
        NVLink's and the node's NICs together (rail-aligned rings)."""
        if n <= self.gpus_per_node:
            return self.nvlink_bandwidth
        return min(self.nvlink_bandwidth, self.gpus_per_node * self.nic_bandwidth)

    def alpha(self, n: int) -> float:
        """Mean latency of a ring step: of the n steps around the ring, one per node crosses
        the network."""
        nodes = math.ceil(n / self.gpus_per_node)
        if nodes == 1:
            return self.nvlink_alpha
        return ((n - nodes) * self.nvlink_alpha + nodes * self.nic_alpha) / n

    def time(self, kind: str, size: int, n: int) -> float:
        """Seconds of one collective over n ranks; `size` the whole buffer in bytes (an
        all-reduce's or a reduce's tensor, the gathered or scattered tensor)."""
        if n <= 1 or size <= 0:
            return 0.0
        ring = KINDS[kind]
        steps = 2 * (n - 1) if ring == ALL_REDUCE else n - 1
        factor = {ALL_REDUCE: 2 * (n - 1) / n, REDUCE: 1.0}.get(ring, (n - 1) / n)
        return steps * self.alpha(n) + factor * size / self.bandwidth(n)


# nccl-tests on 8 x H100/H200 with the ring algorithm: 365-370 GB/s for all-reduce,
# reduce-scatter and all-gather (NCCL's maintainer: "an effective NVLink bandwidth of
# 370GB/s" of the 450 GB/s line rate). A 400 Gb/s NDR NIC: 46-48 GB/s as NCCL reaches it.
# Latencies: NCCL's own tuning constants for the LL128 protocol (src/graph/tuning.cc): 1.9 us
# per NVLink step, 4.0 us per network step (8-GPU all-reduce: 14 x 1.9 = 27 us; measured
# 18-33 us).
HOPPER_IB = Fabric(
    name="H100/H200 nodes: NVLink 4 within (8 GPUs), 400 Gb/s InfiniBand per GPU across",
    gpus_per_node=8,
    nvlink_bandwidth=370 * GB,
    nic_bandwidth=47 * GB,
    nvlink_alpha=1.9e-6,
    nic_alpha=4.0e-6,
)


def fabric(
    gpus_per_node: int | None = None,
    nvlink_gbs: float | None = None,
    nic_gbs: float | None = None,
    base: Fabric = HOPPER_IB,
) -> Fabric:
    """`base` with a user's own figures (GB/s per GPU and direction, as a ring reaches them)."""
    for flag, value in (
        ("--gpus-per-node", gpus_per_node),
        ("--nvlink-gbs", nvlink_gbs),
        ("--nic-gbs", nic_gbs),
    ):
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} {value} must be > 0")
    changed = {
        k: v
        for k, v in (
            ("gpus_per_node", gpus_per_node),
            ("nvlink_bandwidth", None if nvlink_gbs is None else nvlink_gbs * GB),
            ("nic_bandwidth", None if nic_gbs is None else nic_gbs * GB),
        )
        if v is not None
    }
    if not changed:
        return base
    return replace(base, name=base.name + " (with the user's figures)", **changed)
