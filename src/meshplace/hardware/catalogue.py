"""The device catalogue: peak FLOP/s per dtype, memory and per-op overhead, with sources.

Every number is a dense (no sparsity) datasheet peak unless a comment says otherwise, and
carries its source. Conventions:

- FLOP/s count a fused multiply-add as two FLOPs.
- Memory bandwidth is in bytes/s with decimal prefixes (1 GB/s = 1e9 bytes/s).
- Accelerator memory capacity is in binary units: the "16 GB" / "80 GB" of NVIDIA datasheets
  is what ``nvidia-smi`` reports as 16,384 / 81,920 MiB, and Google states TPU HBM in GiB.
- ``launch_overhead_s`` is the fixed cost of dispatching one op (kernel launch, framework
  dispatch), which a cost model adds to each op's roofline time.

Peaks are what the hardware can do, not what models get: XSP (Li et al., IPDPS 2020) found
real models reach at most ~52% of peak, so the cost model calibrates against measurements.

>>> device_spec("v100").peak("float16") / 1e12
125.0
>>> device_spec("k80").peak("bfloat16") == device_spec("k80").peak("float32")
True
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace
from typing import Any

from meshplace.hardware.errors import UnknownDeviceError

GiB = 2**30
DTYPES = ("float32", "float16", "bfloat16", "tf32", "float64")
CATEGORIES = ("cpu", "gpu", "tpu", "accelerator")
TRANSFER_MODES = ("overlap", "occupy")

# Which dtype's peak stands in for a dtype a device does not list, tried in order.
# - float16 -> bfloat16: TPUs have no fp16 path; XLA computes fp16 matmuls on the bf16 MXU.
# - bfloat16 -> float32 (never -> float16): chips without bf16 units (P100, V100, Kepler,
#   most CPUs) run bf16 through fp32 arithmetic, so fp32 is the honest rate.
# - tf32 -> float32: TF32 is an fp32 tensor-core mode; without tensor cores it is fp32.
# - float64 -> float32: optimistic, used only where fp64 has no hardware (TPUs, which
#   emulate it in software); every GPU and CPU here lists float64 explicitly.
# - any other dtype (int8, float8, ...) -> float32.
FALLBACKS: dict[str, tuple[str, ...]] = {
    "float32": ("float32",),
    "float16": ("float16", "bfloat16", "float32"),
    "bfloat16": ("bfloat16", "float32"),
    "tf32": ("tf32", "float32"),
    "float64": ("float64", "float32"),
}
_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "fp64": "float64",
    "double": "float64",
    "f64": "float64",
    "tensorfloat32": "tf32",
}


def normalize_dtype(dtype: str) -> str:
    """``'torch.bfloat16'``, ``'bf16'`` -> ``'bfloat16'``; unknown names are returned as given.

    >>> normalize_dtype("torch.float16")
    'float16'
    """
    name = dtype.strip().lower().removeprefix("torch.").removeprefix("jnp.")
    return _ALIASES.get(name, name)


@dataclass(frozen=True)
class DeviceSpec:
    """What one device can do. Immutable; make variants with :meth:`with_overrides`.

    Attributes:
        kind: catalogue key, e.g. ``"a100-80gb"``.
        description: one line naming the exact part.
        peak_flops: dtype name -> dense peak FLOP/s; keys among :data:`DTYPES`.
        memory_bandwidth: device-memory bandwidth, bytes/s.
        memory_bytes: device-memory capacity, bytes.
        launch_overhead_s: fixed cost per op (kernel launch / dispatch), seconds.
        source: where the numbers come from.
        category: ``"cpu"``, ``"gpu"``, ``"tpu"`` or ``"accelerator"`` (a key cost models may
            use, e.g. to look up an op's ``measured_time["cpu"]``).
        transfers: ``"overlap"`` (default: a copy/DMA engine moves data while the device
            computes, as on GPUs and TPUs) or ``"occupy"`` (no such engine: the device is
            busy for the whole of every transfer it sends or receives, as a CPU process,
            an FPGA or a host-driven accelerator is); :mod:`meshplace.sim.engine` says
            exactly how each is simulated.
    """

    kind: str
    description: str
    peak_flops: dict[str, float] = field(hash=False)
    memory_bandwidth: float
    memory_bytes: int
    launch_overhead_s: float
    source: str
    category: str = "accelerator"
    transfers: str = "overlap"

    def peak(self, dtype: str) -> float:
        """Best dense peak FLOP/s for ``dtype``, falling back along :data:`FALLBACKS`
        (float16 -> bfloat16 -> float32; bfloat16 -> float32; tf32 -> float32;
        float64 -> float32; anything else -> float32).

        >>> device_spec("tpu-v3").peak("float16") == device_spec("tpu-v3").peak("bfloat16")
        True
        """
        name = normalize_dtype(dtype)
        for candidate in FALLBACKS.get(name, (name, "float32")):
            if candidate in self.peak_flops:
                return self.peak_flops[candidate]
        return max(self.peak_flops.values()) if self.peak_flops else 0.0

    def with_overrides(self, **changes: Any) -> DeviceSpec:
        """A copy with some fields changed; ``peak_flops`` given here is merged into (not
        replacing) the existing dict.

        >>> device_spec("v100").with_overrides(memory_bytes=32 * GiB).memory_bytes // GiB
        32
        """
        if "peak_flops" in changes:
            changes["peak_flops"] = {**self.peak_flops, **changes["peak_flops"]}
        return replace(self, **changes)


T = 1e12
G = 1e9

# Placeto (Addanki et al., NeurIPS 2019), simulator calibrated on AWS p2.8xlarge (K80):
# 5.7 µs per-op overhead.
_PLACETO_OP_OVERHEAD = 5.7e-6
# CUDA kernel launch plus framework dispatch on Pascal and later: ~5 µs is the commonly
# measured order of magnitude (empty-kernel launch alone is 2-4 µs); an estimate, calibrate.
_CUDA_OP_OVERHEAD = 5e-6
# TPUs: XLA compiles a whole step into one on-device program, so there is no host dispatch
# per op; what remains per (fused) op is on-chip sequencing and pipeline fill, of order a
# couple of µs. Estimate, not a measurement.
_TPU_OP_OVERHEAD = 2e-6
# CPU: an eager framework op on the host costs a few µs of dispatch (estimate).
_CPU_OP_OVERHEAD = 2e-6
# TPU fp32: the MXU multiplies bf16. We model float32 matmuls at XLA precision HIGH
# ("bf16_3x": three bf16 passes, close to fp32 accuracy), i.e. a third of the bf16 peak.
# (Precision DEFAULT would run fp32 at the bf16 rate, HIGHEST takes six passes.)
_TPU_FP32_PASSES = 3


def _tpu(kind: str, desc: str, bf16: float, mem: int, bw: float, source: str) -> DeviceSpec:
    return DeviceSpec(
        kind=kind,
        description=desc,
        peak_flops={"bfloat16": bf16, "float32": bf16 / _TPU_FP32_PASSES},
        memory_bandwidth=bw,
        memory_bytes=mem,
        launch_overhead_s=_TPU_OP_OVERHEAD,
        source=source + "; float32 = bf16 peak / 3 (XLA precision HIGH, bf16_3x)",
        category="tpu",
    )


_SPECS: tuple[DeviceSpec, ...] = (
    # ---------------------------------------------------------------- CPUs
    # Generic two-socket server: 2 x Intel Xeon Gold 6148 (Skylake-SP, 20 cores, 2.4 GHz,
    # 6 DDR4-2666 channels per socket), the host of e.g. NERSC Cori GPU nodes (384 GB).
    # Each core has two AVX-512 FMA units: 2 x 16 fp32 lanes x 2 FLOP = 64 FLOP/cycle
    # (32 in fp64). Clocked at the 1.6 GHz AVX-512 all-core base (verify; nominal 2.4 GHz
    # would give 6.1 TF): 2 x 20 x 64 x 1.6e9 = 4.1 TFLOP/s fp32, 2.05 fp64.
    # Memory: 2 sockets x 6 channels x 8 B x 2.666 GT/s = 256 GB/s.
    DeviceSpec(
        kind="xeon",
        description="generic 2-socket Xeon: 2 x Gold 6148 (Skylake-SP, 2 x 20 cores, AVX-512)",
        peak_flops={"float32": 2 * 20 * 64 * 1.6e9, "float64": 2 * 20 * 32 * 1.6e9},
        memory_bandwidth=2 * 6 * 8 * 2.666e9,
        memory_bytes=384 * GiB,
        launch_overhead_s=_CPU_OP_OVERHEAD,
        source=(
            "Intel Xeon Gold 6148 datasheet (20 cores, AVX-512 2 FMA/cycle, 6 x DDR4-2666); "
            "node as NERSC Cori GPU (2 sockets, 384 GB); arithmetic in catalogue.py"
        ),
        category="cpu",
    ),
    # ColocRL's host: "Intel Haswell 2300 CPU, which has 18 cores" (Mirhoseini et al. 2017,
    # sec. 4; verify) = Xeon E5-2699 v3: 18 cores, 2.3 GHz, AVX2 with 2 FMA/cycle:
    # 2 x 8 fp32 lanes x 2 = 32 FLOP/cycle -> 18 x 32 x 2.3e9 = 1.32 TFLOP/s fp32, 0.66 fp64.
    # Memory: 4 x DDR4-2133 = 68 GB/s. Capacity not stated by the paper: 128 GiB assumed.
    DeviceSpec(
        kind="xeon-e5-2699v3",
        description="Intel Xeon E5-2699 v3 (Haswell-EP, 18 cores @ 2.3 GHz, AVX2), one socket",
        peak_flops={"float32": 18 * 32 * 2.3e9, "float64": 18 * 16 * 2.3e9},
        memory_bandwidth=4 * 8 * 2.133e9,
        memory_bytes=128 * GiB,
        launch_overhead_s=_CPU_OP_OVERHEAD,
        source=(
            "Intel ARK E5-2699 v3 (18 cores, 2.3 GHz, 4 x DDR4-2133); ColocRL testbed CPU "
            "(Mirhoseini et al., ICML 2017); 128 GiB memory assumed"
        ),
        category="cpu",
    ),
    # DGX A100 host CPU: AMD EPYC 7742 (Zen 2, 64 cores, 2.25 GHz base, 8 x DDR4-3200).
    # Zen 2: two 256-bit FMA pipes = 32 fp32 FLOP/cycle -> 64 x 32 x 2.25e9 = 4.6 TFLOP/s.
    # Memory: 8 x 8 B x 3.2 GT/s = 204.8 GB/s; DGX A100 (640 GB) has 2 TB, 1 TiB per socket.
    DeviceSpec(
        kind="epyc-7742",
        description="AMD EPYC 7742 (Zen 2, 64 cores @ 2.25 GHz, AVX2), one socket",
        peak_flops={"float32": 64 * 32 * 2.25e9, "float64": 64 * 16 * 2.25e9},
        memory_bandwidth=8 * 8 * 3.2e9,
        memory_bytes=1024 * GiB,
        launch_overhead_s=_CPU_OP_OVERHEAD,
        source="AMD EPYC 7742 product page; NVIDIA DGX A100 datasheet (2 x 7742, 2 TB RAM)",
        category="cpu",
    ),
    # DGX H100 host CPU: Intel Xeon Platinum 8480C (Sapphire Rapids, 56 cores, 2.0 GHz,
    # 8 x DDR5-4800). AVX-512 2 FMA: 64 fp32 FLOP/cycle -> 56 x 64 x 2.0e9 = 7.2 TFLOP/s.
    # AMX bf16 tiles are left out (frameworks rarely reach them; bf16 falls back to fp32).
    # Memory: 8 x 8 B x 4.8 GT/s = 307.2 GB/s; DGX H100 has 2 TB, 1 TiB per socket.
    DeviceSpec(
        kind="xeon-8480c",
        description="Intel Xeon Platinum 8480C (Sapphire Rapids, 56 cores @ 2.0 GHz), one socket",
        peak_flops={"float32": 56 * 64 * 2.0e9, "float64": 56 * 32 * 2.0e9},
        memory_bandwidth=8 * 8 * 4.8e9,
        memory_bytes=1024 * GiB,
        launch_overhead_s=_CPU_OP_OVERHEAD,
        source="Intel Xeon Platinum 8480+ specifications; NVIDIA DGX H100 datasheet (2 TB RAM)",
        category="cpu",
    ),
    # ---------------------------------------------------------------- NVIDIA GPUs
    # Tesla K40 board spec: 4.29 TFLOP/s fp32 and 1.43 fp64 at 745 MHz base (2,880 cores),
    # 12 GB GDDR5, 288 GB/s.
    DeviceSpec(
        kind="k40",
        description="NVIDIA Tesla K40 (GK110B, PCIe)",
        peak_flops={"float32": 4.29 * T, "float64": 1.43 * T},
        memory_bandwidth=288 * G,
        memory_bytes=12 * GiB,
        launch_overhead_s=_PLACETO_OP_OVERHEAD,
        source=(
            "NVIDIA Tesla K40 board specification (4.29 TF fp32, 1.43 TF fp64, 12 GB, "
            "288 GB/s); launch overhead: Placeto (NeurIPS 2019) 5.7 us/op on Kepler K80"
        ),
        category="gpu",
    ),
    # One GK210 die of a Tesla K80 board (the board = 2 dies = 2 CUDA devices). Board spec:
    # 8.74 TF fp32 / 2.91 TF fp64 at boost, 24 GB, 480 GB/s. Per die: 2,496 cores x 2 FLOP x
    # 875 MHz boost = 4.37 TF fp32 (2.80 TF at 560 MHz base), fp64 1.46 TF, 12 GB, 240 GB/s.
    # (The 2.91 TF sometimes quoted per die is the board's fp64 figure.)
    DeviceSpec(
        kind="k80",
        description="NVIDIA Tesla K80, one GK210 die (half a board), boost clock",
        peak_flops={"float32": 2496 * 2 * 0.875e9, "float64": 2.91 * T / 2},
        memory_bandwidth=240 * G,
        memory_bytes=12 * GiB,
        launch_overhead_s=_PLACETO_OP_OVERHEAD,
        source=(
            "NVIDIA Tesla K80 datasheet (board: 8.74 TF fp32 / 2.91 TF fp64 boost, 24 GB, "
            "480 GB/s; halved per die); launch overhead 5.7 us/op measured by Placeto "
            "(Addanki et al., NeurIPS 2019) on K80"
        ),
        category="gpu",
    ),
    # Tesla P100 SXM2: 10.6 TF fp32, 21.2 fp16, 5.3 fp64, 16 GB HBM2, 732 GB/s.
    DeviceSpec(
        kind="p100",
        description="NVIDIA Tesla P100 SXM2 (NVLink) 16 GB",
        peak_flops={"float32": 10.6 * T, "float16": 21.2 * T, "float64": 5.3 * T},
        memory_bandwidth=732 * G,
        memory_bytes=16 * GiB,
        launch_overhead_s=_CUDA_OP_OVERHEAD,
        source="NVIDIA Tesla P100 datasheet (SXM2: 10.6/21.2/5.3 TF, 16 GB, 732 GB/s)",
        category="gpu",
    ),
    # Tesla V100 SXM2: 15.7 TF fp32, 7.8 fp64, 125 fp16 tensor, 16 GB (a 32 GB variant
    # exists: override memory_bytes: 32 GiB), 900 GB/s. No bf16 units.
    DeviceSpec(
        kind="v100",
        description="NVIDIA Tesla V100 SXM2 16 GB (32 GB variant: override memory_bytes)",
        peak_flops={"float32": 15.7 * T, "float16": 125 * T, "float64": 7.8 * T},
        memory_bandwidth=900 * G,
        memory_bytes=16 * GiB,
        launch_overhead_s=_CUDA_OP_OVERHEAD,
        source="NVIDIA Tesla V100 datasheet (SXM2: 15.7 TF fp32, 125 TF tensor, 900 GB/s)",
        category="gpu",
    ),
    # A100 SXM4: 19.5 TF fp32, 156 TF tf32, 312 TF bf16/fp16 (dense), 19.5 TF fp64 tensor
    # core (9.7 without). 40 GB HBM2 at 1,555 GB/s; 80 GB HBM2e at 2,039 GB/s.
    DeviceSpec(
        kind="a100-40gb",
        description="NVIDIA A100 SXM4 40 GB",
        peak_flops={
            "float32": 19.5 * T,
            "tf32": 156 * T,
            "bfloat16": 312 * T,
            "float16": 312 * T,
            "float64": 19.5 * T,
        },
        memory_bandwidth=1555 * G,
        memory_bytes=40 * GiB,
        launch_overhead_s=_CUDA_OP_OVERHEAD,
        source="NVIDIA A100 datasheet (SXM4 40 GB: 19.5/156/312 TF dense, 1,555 GB/s)",
        category="gpu",
    ),
    DeviceSpec(
        kind="a100-80gb",
        description="NVIDIA A100 SXM4 80 GB",
        peak_flops={
            "float32": 19.5 * T,
            "tf32": 156 * T,
            "bfloat16": 312 * T,
            "float16": 312 * T,
            "float64": 19.5 * T,
        },
        memory_bandwidth=2039 * G,
        memory_bytes=80 * GiB,
        launch_overhead_s=_CUDA_OP_OVERHEAD,
        source="NVIDIA A100 datasheet (SXM4 80 GB: 19.5/156/312 TF dense, 2,039 GB/s)",
        category="gpu",
    ),
    # H100 SXM5: 67 TF fp32, 494.5 TF tf32 and 989.4 TF bf16/fp16 dense (the datasheet's
    # 989 / 1,979 are with 2:4 sparsity), 67 TF fp64 tensor core; 80 GB HBM3, 3.35 TB/s.
    DeviceSpec(
        kind="h100",
        description="NVIDIA H100 SXM5 80 GB",
        peak_flops={
            "float32": 67 * T,
            "tf32": 494.5 * T,
            "bfloat16": 989.4 * T,
            "float16": 989.4 * T,
            "float64": 67 * T,
        },
        memory_bandwidth=3.35e12,
        memory_bytes=80 * GiB,
        launch_overhead_s=_CUDA_OP_OVERHEAD,
        source="NVIDIA H100 datasheet (SXM: 67 TF fp32, 989 TF bf16 dense, 3.35 TB/s)",
        category="gpu",
    ),
    # H200 SXM: the H100's compute with 141 GB HBM3e at 4.8 TB/s.
    DeviceSpec(
        kind="h200",
        description="NVIDIA H200 SXM 141 GB",
        peak_flops={
            "float32": 67 * T,
            "tf32": 494.5 * T,
            "bfloat16": 989.4 * T,
            "float16": 989.4 * T,
            "float64": 67 * T,
        },
        memory_bandwidth=4.8e12,
        memory_bytes=141 * GiB,
        launch_overhead_s=_CUDA_OP_OVERHEAD,
        source="NVIDIA H200 datasheet (H100 compute, 141 GB HBM3e, 4.8 TB/s)",
        category="gpu",
    ),
    # ---------------------------------------------------------------- TPUs (one chip each)
    # Cloud TPU v2: 45 TF bf16 per chip (2 TensorCores), 16 GiB HBM, 600 GB/s.
    # (Jouppi et al., CACM 2020, tabulate 46 TF and 700 GB/s.)
    _tpu(
        "tpu-v2",
        "Google Cloud TPU v2 chip (2 TensorCores)",
        45 * T,
        16 * GiB,
        600 * G,
        "Cloud TPU v2 system architecture (45 TF bf16, 16 GiB HBM, 600 GB/s per chip)",
    ),
    # Cloud TPU v3: 123 TF bf16 per chip, 32 GiB HBM2 at 900 GB/s.
    _tpu(
        "tpu-v3",
        "Google Cloud TPU v3 chip (2 TensorCores)",
        123 * T,
        32 * GiB,
        900 * G,
        "Cloud TPU v3 docs (123 TF bf16, 32 GiB HBM2, 900 GBps per chip); Jouppi et al. 2020",
    ),
    # Cloud TPU v4: 275 TF bf16 per chip, 32 GiB HBM2 at 1,200 GB/s.
    _tpu(
        "tpu-v4",
        "Google Cloud TPU v4 chip (2 TensorCores)",
        275 * T,
        32 * GiB,
        1200 * G,
        "Cloud TPU v4 docs (275 TF bf16, 32 GiB HBM2, 1,200 GBps); Jouppi et al., ISCA 2023",
    ),
    # ---------------------------------------------------------------- generic
    # A round-number stand-in for what-if studies (a device that does not exist): between
    # an A100 and an H100. Override any field in YAML to model a real part.
    DeviceSpec(
        kind="accelerator",
        description="generic accelerator (round numbers for what-if studies)",
        peak_flops={"float32": 25 * T, "tf32": 100 * T, "bfloat16": 200 * T, "float16": 200 * T},
        memory_bandwidth=1e12,
        memory_bytes=32 * GiB,
        launch_overhead_s=_CUDA_OP_OVERHEAD,
        source="meshplace placeholder: round numbers, not a real part",
        category="accelerator",
    ),
)

_CATALOGUE: dict[str, DeviceSpec] = {s.kind: s for s in _SPECS}
# Short names accepted wherever a kind is: "a100" is the 80 GB part.
KIND_ALIASES = {"a100": "a100-80gb", "cpu": "xeon", "tpu": "tpu-v3"}


def catalogue() -> dict[str, DeviceSpec]:
    """All built-in device kinds, kind -> spec (a fresh dict; the specs are immutable).

    >>> sorted(catalogue())[:3]
    ['a100-40gb', 'a100-80gb', 'accelerator']
    """
    return dict(_CATALOGUE)


def device_spec(kind: str) -> DeviceSpec:
    """The catalogue spec of ``kind`` (aliases: ``a100`` -> ``a100-80gb``, ``cpu`` -> ``xeon``,
    ``tpu`` -> ``tpu-v3``).

    Raises :class:`UnknownDeviceError` naming the allowed kinds.

    >>> device_spec("h100").memory_bytes // GiB
    80
    """
    key = KIND_ALIASES.get(kind, kind)
    try:
        return _CATALOGUE[key]
    except KeyError:
        close = difflib.get_close_matches(str(kind).lower(), [*_CATALOGUE, *KIND_ALIASES], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownDeviceError(
            f"unknown device kind {kind!r}{hint}; allowed kinds: {', '.join(_CATALOGUE)}"
        ) from None
