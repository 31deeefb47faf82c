"""The links a weight sync crosses in the simulator (``asyncflow simulate --link``;
docs/weight-sync.md, "In the simulator").

A link is a bandwidth (GB/s, 1 GB = 1e9 bytes, one direction, what one transfer can use) and a
latency (seconds, paid once per message: per bucket of a collective, per object of the store).
The presets are the nominal figures of common hardware, not measurements of this machine:

==========  =======  ==========  ==============================================================
name        GB/s     latency     source
==========  =======  ==========  ==============================================================
pcie        25       10 us       PCIe 4.0 x16: 16 GT/s x 16 lanes = 31.5 GB/s raw per direction
                                 (PCI-SIG, PCIe 4.0 base specification); ~25 GB/s is what a
                                 pinned host<->GPU copy reaches (NVIDIA's bandwidthTest)
nvlink      450      5 us        NVLink 4 (H100 SXM): 900 GB/s bidirectional per GPU, 450 each
                                 way (NVIDIA H100 Tensor Core GPU datasheet)
infiniband  50       5 us        InfiniBand NDR: 400 Gb/s per port = 50 GB/s (NVIDIA ConnectX-7
                                 datasheet; the port a GPU node has per GPU)
ethernet    3.125    50 us       25 Gb/s Ethernet (IEEE 802.3by) = 3.125 GB/s: a commodity
                                 cluster's node-to-node link, the one Ray's object store uses
==========  =======  ==========  ==============================================================

The default (:data:`DEFAULT`) is ``ethernet`` whatever the pipeline: the conservative choice, and
the link an object store crosses between nodes. ``--link`` also takes ``GBPS`` or
``GBPS:LATENCY_US`` (e.g. ``12.5:20``) for a link of one's own.

Host-side copies (a trainer's export to a CPU state dict, packing it, the put into the object
store, a replica's load into its device) cross :data:`HOST`, PCIe, whatever ``--link`` says.
"""
from __future__ import annotations

from dataclasses import dataclass

from asyncflow.errors import AsyncflowError


@dataclass(frozen=True)
class Link:
    """A link: ``gb_s`` GB/s (1e9 bytes a second) and ``latency_s`` per message."""

    name: str
    gb_s: float
    latency_s: float

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        """Seconds to move ``nbytes`` in ``messages`` messages (0 bytes: 0 s)."""
        if nbytes <= 0:
            return 0.0
        return max(1, messages) * self.latency_s + nbytes / (self.gb_s * 1e9)

    def describe(self) -> str:
        return f"{self.name} ({self.gb_s:g} GB/s, {self.latency_s * 1e6:g} us)"


LINKS: dict[str, Link] = {
    "pcie": Link("pcie", 25.0, 10e-6),
    "nvlink": Link("nvlink", 450.0, 5e-6),
    "infiniband": Link("infiniband", 50.0, 5e-6),
    "ethernet": Link("ethernet", 3.125, 50e-6),
}
ALIASES = {"ib": "infiniband", "eth": "ethernet", "nvl": "nvlink"}
DEFAULT = "ethernet"
#: the host-side copies of a sync (export, pack, put, load into the device): PCIe
HOST = LINKS["pcie"]


class LinkError(AsyncflowError):
    """``--link`` names no preset and is no ``GBPS[:LATENCY_US]`` (a usage error of
    ``asyncflow simulate``, exit 2)."""


def link(spec: str | Link | None) -> Link:
    """The link ``spec`` names: a preset (:data:`LINKS`), ``GBPS`` or ``GBPS:LATENCY_US``; None:
    the default."""
    if isinstance(spec, Link):
        return spec
    s = (spec or DEFAULT).strip().lower()
    s = ALIASES.get(s, s)
    if s in LINKS:
        return LINKS[s]
    bw, _, lat = s.partition(":")
    try:
        gb_s = float(bw)
        latency_s = float(lat) * 1e-6 if lat else 10e-6
    except ValueError:
        raise LinkError(f"--link {spec!r}: expected one of {', '.join(LINKS)} or GBPS[:LATENCY_US]"
                        " (e.g. 12.5:20)") from None
    if not gb_s > 0 or latency_s < 0 or gb_s != gb_s:
        raise LinkError(f"--link {spec!r}: the bandwidth must be > 0 GB/s and the latency >= 0")
    return Link(f"{gb_s:g} GB/s", gb_s, latency_s)
