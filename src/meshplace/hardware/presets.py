"""Built-in clusters, each with its source, and :func:`load_cluster` (preset name or YAML file).

Presets are Python builders (no data files). Besides the fixed names in :func:`presets`,
the parametric family ``h{hosts}-{gpus}x{kind}`` — e.g. ``h4-8xa100`` (4 hosts of 8 A100
80 GB) or ``h2-4xv100`` — builds ``hosts`` identical hosts joined by a network:

- NVLink kinds (p100, v100, a100-40gb, a100-80gb / a100, h100, h200, accelerator): each host
  is :func:`~meshplace.hardware.topology.nvlink_mesh` (NVSwitch, 2 CPU sockets, 2 GPUs per
  PCIe switch) and every device has its own NIC (GPUDirect RDMA, one NIC per GPU as in DGX
  systems) at the InfiniBand rate of the GPU's generation: EDR 100 Gb/s for P100/V100, HDR
  200 Gb/s for A100 and the generic accelerator, NDR 400 Gb/s for H100/H200.
- PCIe-only kinds (k40, k80): each host is :func:`~meshplace.hardware.topology.pcie_tree`
  (2 GPUs per switch) with one 25 Gb/s Ethernet NIC at the root complex (AWS p2.16xlarge
  class networking; verify).

>>> c = load_cluster("h4-8xa100")
>>> len(c), c.devices[2].name
(40, 'host0/gpu0')
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from pathlib import Path

from meshplace.hardware.catalogue import KIND_ALIASES, catalogue
from meshplace.hardware.cluster import Cluster
from meshplace.hardware.errors import ClusterError, UnknownPresetError
from meshplace.hardware.topology import (
    EDR_IB,
    HDR_IB,
    NDR_IB,
    NIC_LATENCY,
    PCIE3_X16,
    PCIE3_X16_MEASURED,
    PCIE4_X16,
    PCIE5_X16,
    TPU_V3_ICI,
    TPU_V4_ICI,
    multi_host,
    nvlink_mesh,
    pcie_tree,
    torus,
)

FAMILY_PATTERN = "h{hosts}-{gpus}x{kind}"
_FAMILY_RE = re.compile(r"^h(\d+)-(\d+)x([a-z0-9][a-z0-9-]*)$")
_MAX_FAMILY_DEVICES = 1 << 16

# Placeto (Addanki et al., NeurIPS 2019), simulator calibrated on AWS p2.8xlarge (K80s).
_PLACETO = {
    "placeto_op_overhead_s": 5.7e-6,
    "placeto_transfer_overhead_s": 25e-6,
    "placeto_transfer_rate": 7.6e9,  # 7,600 bytes/µs
    "note": (
        "link bandwidth is measured PCIe3 x16 (~10 GB/s); Placeto's calibrated effective "
        "rate 7,600 bytes/us and 25 us per-transfer overhead include software costs"
    ),
}


def _colocrl(gpus: int) -> Cluster:
    c = pcie_tree(
        gpus,
        2,
        gpu_kind="k80",
        cpu_kind="xeon-e5-2699v3",
        gpu_link_bandwidth=PCIE3_X16_MEASURED,
        uplink_bandwidth=PCIE3_X16_MEASURED,
        name=f"colocrl-{gpus}gpu",
        source=(
            "ColocRL testbed (Mirhoseini et al., ICML 2017): one Haswell 18-core CPU and "
            f"{gpus} K80 GPU dies, two dies per board behind the board's PCIe switch; PCIe3 "
            "x16 at ~10 GB/s measured; Placeto (NeurIPS 2019) calibration in meta"
        ),
    )
    c.meta.update(_PLACETO)
    return c


def _dgx_a100() -> Cluster:
    return nvlink_mesh(
        8,
        gpu_kind="a100-80gb",
        cpus=2,
        cpu_kind="epyc-7742",
        pcie_bandwidth=PCIE4_X16,
        gpus_per_pcie_switch=2,
        name="dgx-a100",
        source=(
            "NVIDIA DGX A100 datasheet and system architecture white paper: 8 x A100 80 GB, "
            "6 NVSwitches (600 GB/s per GPU, 300 each way), 2 x EPYC 7742, 4 PCIe4 switches"
        ),
    )


def _dgx_h100() -> Cluster:
    return nvlink_mesh(
        8,
        gpu_kind="h100",
        cpus=2,
        cpu_kind="xeon-8480c",
        pcie_bandwidth=PCIE5_X16,
        gpus_per_pcie_switch=2,
        name="dgx-h100",
        source=(
            "NVIDIA DGX H100 datasheet: 8 x H100 SXM 80 GB, 4 NVSwitches (900 GB/s per GPU, "
            "450 each way), 2 x Xeon Platinum 8480C, PCIe5"
        ),
    )


def _tpu_v3_8() -> Cluster:
    return torus(
        (2, 2),
        device_kind="tpu-v3",
        link_bandwidth=TPU_V3_ICI,
        name="tpu-v3-8",
        source=(
            "Cloud TPU v3-8: one host, 4 chips (8 TensorCores) as a 2x2 torus; one device per "
            "chip (its 2 cores merged, 123 TF); each 2-ring's two links merged (2 x 100 GB/s)"
        ),
    )


def _tpu_v3_pod() -> Cluster:
    return torus(
        (32, 32),
        device_kind="tpu-v3",
        link_bandwidth=TPU_V3_ICI,
        name="tpu-v3-pod",
        source=(
            "Cloud TPU v3 pod: 1,024 chips in a 2D torus (32x32 with wrap-around), 6.4 TB/s "
            "bisection -> 100 GB/s per link each way (Cloud TPU v3 docs; Kumar et al. 2019)"
        ),
    )


def _tpu_v4_pod() -> Cluster:
    return torus(
        (16, 16, 16),
        device_kind="tpu-v4",
        link_bandwidth=TPU_V4_ICI,
        chips_per_host=(2, 2, 1),
        name="tpu-v4-pod",
        source=(
            "TPU v4 pod: 4,096 chips as a 16x16x16 3D torus (64 cubes of 4x4x4 joined by "
            "optical circuit switches; Jouppi et al., ISCA 2023; Cloud TPU v4 docs, 24 TB/s "
            "bisection -> ~45 GB/s per link each way); twisted tori not modelled"
        ),
    )


_PRESETS: dict[str, tuple[str, Callable[[], Cluster]]] = {
    "colocrl-2gpu": (
        "ColocRL testbed: 1 Haswell Xeon + 2 K80 dies under one PCIe switch (3 devices)",
        lambda: _colocrl(2),
    ),
    "colocrl-4gpu": (
        "ColocRL testbed: 1 Haswell Xeon + 4 K80 dies, 2 per PCIe switch (5 devices)",
        lambda: _colocrl(4),
    ),
    "dgx-a100": (
        "NVIDIA DGX A100: 8 A100 80 GB on NVSwitch (300 GB/s each way) + 2 EPYC CPUs",
        _dgx_a100,
    ),
    "dgx-h100": (
        "NVIDIA DGX H100: 8 H100 on NVSwitch (450 GB/s each way) + 2 Xeon CPUs",
        _dgx_h100,
    ),
    "tpu-v3-8": ("Cloud TPU v3-8: 4 TPU v3 chips in a 2x2 torus", _tpu_v3_8),
    "tpu-v3-pod": ("TPU v3 pod: 1,024 chips, 32x32 2D torus, 100 GB/s links", _tpu_v3_pod),
    "tpu-v4-pod": ("TPU v4 pod: 4,096 chips, 16x16x16 3D torus, 45 GB/s links", _tpu_v4_pod),
    "h4-8xa100": (
        "4 hosts x 8 A100 80 GB (NVSwitch inside, 8 x 200 Gb/s HDR per host between)",
        lambda: family_cluster(4, 8, "a100-80gb", name="h4-8xa100"),
    ),
    "h2-8xh100": (
        "2 hosts x 8 H100 (NVSwitch inside, 8 x 400 Gb/s NDR per host between)",
        lambda: family_cluster(2, 8, "h100", name="h2-8xh100"),
    ),
}

# Per GPU kind in the h{hosts}-{gpus}x{kind} family: (CPU kind, PCIe rate each way, per-GPU
# NIC rate each way). PCIe generations from the GPUs' datasheets; NICs as in DGX-1 (EDR),
# DGX A100 (HDR) and DGX H100 (NDR).
_FAMILY_NVLINK: dict[str, tuple[str, float, float]] = {
    "p100": ("xeon", PCIE3_X16, EDR_IB),
    "v100": ("xeon", PCIE3_X16, EDR_IB),
    "a100-40gb": ("epyc-7742", PCIE4_X16, HDR_IB),
    "a100-80gb": ("epyc-7742", PCIE4_X16, HDR_IB),
    "h100": ("xeon-8480c", PCIE5_X16, NDR_IB),
    "h200": ("xeon-8480c", PCIE5_X16, NDR_IB),
    "accelerator": ("xeon", PCIE4_X16, HDR_IB),
}
_FAMILY_PCIE = ("k40", "k80")
# 25 Gb/s Ethernet per K40/K80 host (AWS p2.16xlarge class; verify).
_ETHERNET_25G = 25e9 / 8


def family_kinds() -> list[str]:
    """GPU kinds accepted by the ``h{hosts}-{gpus}x{kind}`` family (plus alias ``a100``)."""
    return [*_FAMILY_PCIE, *_FAMILY_NVLINK]


def family_cluster(hosts: int, gpus: int, kind: str, *, name: str | None = None) -> Cluster:
    """``hosts`` hosts of ``gpus`` GPUs of ``kind`` (see the module docstring for the model).

    O(hosts x gpus) devices and links.

    >>> len(family_cluster(2, 4, "v100"))
    12
    """
    key = KIND_ALIASES.get(kind, kind)
    label = name or f"h{hosts}-{gpus}x{kind}"
    if hosts < 1 or gpus < 1:
        raise ClusterError(f"cluster {label!r}: hosts and gpus must both be at least 1")
    if key in _FAMILY_NVLINK:
        cpu, pcie, nic = _FAMILY_NVLINK[key]

        def build(h: str) -> Cluster:
            return nvlink_mesh(
                gpus,
                gpu_kind=key,
                cpus=2,
                cpu_kind=cpu,
                pcie_bandwidth=pcie,
                gpus_per_pcie_switch=2,
                host=h,
            )

        c = multi_host(
            hosts,
            build,
            nic_bandwidth=nic,
            nic_latency=NIC_LATENCY,
            nic_per_device=True,
            name=label,
            source=(
                f"meshplace {FAMILY_PATTERN} family: DGX-style hosts (NVSwitch, 2 GPUs per "
                f"PCIe switch) with one {nic * 8 / 1e9:g} Gb/s NIC per device, one "
                "non-blocking network switch"
            ),
        )
    elif key in _FAMILY_PCIE:

        def build(h: str) -> Cluster:
            return pcie_tree(gpus, 2, gpu_kind=key, cpu_kind="xeon", host=h)

        c = multi_host(
            hosts,
            build,
            nic_bandwidth=_ETHERNET_25G,
            nic_latency=NIC_LATENCY,
            nic_attach=["pcie-root"],
            name=label,
            source=(
                f"meshplace {FAMILY_PATTERN} family: PCIe hosts (2 GPUs per switch, PCIe3 ~10 "
                "GB/s) with one 25 Gb/s Ethernet NIC each, one network switch"
            ),
        )
    else:
        raise UnknownPresetError(
            f"cluster {label!r}: kind {kind!r} cannot build a {FAMILY_PATTERN} cluster; "
            f"allowed kinds: {', '.join([*family_kinds(), 'a100'])}"
        )
    return c


def presets() -> dict[str, str]:
    """Built-in cluster names -> one-line descriptions. The parametric family
    ``h{hosts}-{gpus}x{kind}`` is also accepted by :func:`load_cluster` (two examples are
    listed here).

    >>> "tpu-v3-pod" in presets()
    True
    """
    return {name: desc for name, (desc, _) in _PRESETS.items()}


def build_preset(name: str) -> Cluster:
    """Build the preset or family cluster ``name``; raises :class:`UnknownPresetError`."""
    if name in _PRESETS:
        cluster = _PRESETS[name][1]()
    else:
        m = _FAMILY_RE.match(name)
        if not m:
            close = difflib.get_close_matches(name, list(_PRESETS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UnknownPresetError(
                f"unknown cluster preset {name!r}{hint}; allowed: {', '.join(_PRESETS)}, "
                f"or {FAMILY_PATTERN} (e.g. h2-8xa100), or a path to a .yaml file"
            )
        hosts, gpus, kind = int(m.group(1)), int(m.group(2)), m.group(3)
        if hosts * gpus > _MAX_FAMILY_DEVICES:
            raise UnknownPresetError(
                f"cluster {name!r}: {hosts} x {gpus} GPUs is more than the "
                f"{_MAX_FAMILY_DEVICES} allowed"
            )
        cluster = family_cluster(hosts, gpus, kind, name=name)
    cluster.origin = f"preset {name!r}"
    return cluster


def load_cluster(spec: str | Path) -> Cluster:
    """A cluster from a preset name (see :func:`presets`), a ``h{hosts}-{gpus}x{kind}``
    family name, or a YAML file path (format: ``docs/clusters.md``).

    Raises :class:`UnknownPresetError` (an ``InputError``) naming the allowed presets when
    ``spec`` is none of these, and :class:`ClusterError` for a malformed file.

    >>> len(load_cluster("colocrl-4gpu"))
    5
    """
    from meshplace.hardware.yaml_format import load_cluster_file

    text = str(spec)
    if text and Path(text).is_dir():
        raise ClusterError(f"{text}: is a folder, not a cluster file (YAML) or a preset name")
    if isinstance(spec, Path) or text.endswith((".yaml", ".yml")) or Path(text).is_file():
        return load_cluster_file(text)
    return build_preset(text)


def _check_family_kinds() -> None:  # keep the family table in step with the catalogue
    known = set(catalogue())
    missing = [k for k in family_kinds() if k not in known]
    assert not missing, missing


_check_family_kinds()
