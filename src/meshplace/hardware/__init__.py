"""Hardware: the device catalogue, clusters with deterministic routes, topology generators,
cited presets, and the cluster YAML format.

>>> from meshplace.hardware import load_cluster
>>> c = load_cluster("dgx-a100")
>>> len(c), c.path_bandwidth("gpu0", "gpu7") / 1e9
(10, 300.0)
"""

from meshplace.hardware.catalogue import DTYPES, DeviceSpec, catalogue, device_spec
from meshplace.hardware.cluster import Cluster, Device, Link, TorusRouting
from meshplace.hardware.describe import describe, print_cluster
from meshplace.hardware.errors import ClusterError, UnknownDeviceError, UnknownPresetError
from meshplace.hardware.presets import (
    FAMILY_PATTERN,
    build_preset,
    family_cluster,
    load_cluster,
    presets,
)
from meshplace.hardware.topology import multi_host, nvlink_mesh, pcie_tree, torus
from meshplace.hardware.yaml_format import (
    cluster_from_dict,
    cluster_from_yaml,
    cluster_to_dict,
    cluster_to_yaml,
    load_cluster_file,
    save_cluster,
)

__all__ = [
    "DTYPES",
    "FAMILY_PATTERN",
    "Cluster",
    "ClusterError",
    "Device",
    "DeviceSpec",
    "Link",
    "TorusRouting",
    "UnknownDeviceError",
    "UnknownPresetError",
    "build_preset",
    "catalogue",
    "cluster_from_dict",
    "cluster_from_yaml",
    "cluster_to_dict",
    "cluster_to_yaml",
    "describe",
    "device_spec",
    "family_cluster",
    "load_cluster",
    "load_cluster_file",
    "multi_host",
    "nvlink_mesh",
    "pcie_tree",
    "presets",
    "print_cluster",
    "save_cluster",
    "torus",
]
