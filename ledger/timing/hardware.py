"""Hardware profiles: what a step-time prediction is for (`hardware=<name>`, `hardware.<field>=...`, or a
yaml that `python -m ledger.timing.calibrate` wrote).

A profile holds the device's datasheet figures (peak dense FLOPs, HBM bandwidth, the interconnect per
GPU), each with its source, and how much of them kernels reach: the GEMM efficiency (a fraction of
the peak that large GEMMs reach, shaped by tile and wave quantization in ledger/timing/ops.py, or a
measured table of GEMM throughput by shape that replaces the model), the memory-bound kernels'
fraction of the HBM bandwidth, and per link class the collectives' bus bandwidth and latency
(nccl-tests' busbw; a user's nccl-tests output replaces them). The GPU presets' achievable fractions
are not measured here (no GPU run has confirmed them): they print as "from sources" until a profile
that `calibrate` measured on the device replaces them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from ledger.errors import ConfigError


@dataclass(frozen=True)
class Link:
    """One link class: the bus bandwidth a collective reaches per GPU (GB/s, nccl-tests busbw: a
    ring's per-rank bytes over the time) and the latency of one ring step (microseconds)."""
    busbw_gbps: float  # GB/s (bytes), one direction per GPU
    latency_us: float


@dataclass(frozen=True)
class Profile:
    name: str
    # dense tensor-core peak (TFLOP/s) by dtype, the datasheet's (sparsity not counted)
    peak_tflops: dict
    hbm_gbps: float  # GB/s, the datasheet's
    memory_gb: float
    gpus_per_node: int
    intra: Link  # inside a node (NVLink)
    inter: Link  # between nodes: one NIC (one per GPU); a group drives one per rank it has on a node (collectives.group_link)
    # the fraction of peak_tflops large GEMMs reach (the vendor library on big square shapes)
    gemm_efficiency: float
    # the fraction of hbm_gbps streaming (memory-bound) kernels reach
    memory_efficiency: float
    # streaming multiprocessors and the GEMM tile (M, N) the wave quantization counts in
    sms: int = 0
    gemm_tile: tuple = (128, 256)
    # a kernel's fixed cost (launch and tail), seconds
    kernel_overhead_s: float = 5e-6
    # measured GEMM throughput by shape ((m, n, k, dtype), TFLOP/s), from calibrate; replaces the model
    gemm_table: tuple = ()
    # where each figure comes from, and whether a run on the device measured the achievable fractions
    sources: dict = field(default_factory=dict)
    measured: bool = False
    device: str = "cuda"  # cuda | cpu: which kernels the frameworks run (the time policies ask)
    # attention kernel (ATTENTION_KERNELS) -> (forward, backward) fraction of the bf16 peak it reaches;
    # a kernel not named runs at gemm_efficiency (batched matmuls)
    attention_efficiency: dict = field(default_factory=dict)
    # the host beside each GPU (DeepSpeed's ZeRO-Offload: its optimizer step on the host, the gradients and
    # params over the host link): GB/s each way of one GPU's PCIe link, and the host DRAM's GB/s per GPU
    # (the node's CPU sockets' memory channels over its GPUs); 0: not given (a CPU profile: the host is
    # the device)
    host_link_gbps: float = 0.0
    host_memory_gbps: float = 0.0

    def peak(self, dtype: str = "bf16") -> float:
        """Peak FLOP/s for dtype (bf16 and fp16 share the tensor cores' rate)."""
        key = "bf16" if dtype in ("bf16", "fp16") else dtype
        if key not in self.peak_tflops:
            raise ConfigError(f"hardware={self.name}: no peak for dtype {dtype} (known: {sorted(self.peak_tflops)})")
        return self.peak_tflops[key] * 1e12

    @property
    def target(self) -> str:
        """What the time figures are: measured on the device (calibrate) or from sources."""
        return f"{self.name} ({'calibrated' if self.measured else 'from sources: datasheet peaks, assumed efficiencies'})"


_DATASHEET = {
    "a100": "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOPS bf16 dense, 2,039 GB/s HBM2e, "
            "NVLink 600 GB/s total (300 each way); network: one 200 Gb/s HDR InfiniBand NIC per GPU (DGX A100)",
    "h100": "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOPS bf16 dense, 1,979 fp8, 3.35 TB/s HBM3, "
            "NVLink 900 GB/s total (450 each way); network: one 400 Gb/s NDR NIC per GPU (DGX H100)",
    "h200": "NVIDIA H200 datasheet (SXM): the H100's tensor cores (989 TFLOPS bf16 dense, 1,979 fp8), 141 GB "
            "HBM3e at 4.8 TB/s, NVLink 900 GB/s total; network: one 400 Gb/s NIC per GPU (HGX H200)",
    "b200": "NVIDIA DGX B200 datasheet: 8 GPUs, 72 PFLOPS fp8 training (dense 4.5 PF / GPU, bf16 2.25 PF), "
            "1,440 GB HBM3e (180 GB / GPU) at 8 TB/s each, NVLink 5 1.8 TB/s total (900 each way); "
            "network: one 400 Gb/s NIC per GPU",
    "h100-96gb": "torchtitan docs/performance.md (Grand Teton): H100 with 96 GB HBM2e at 2.4 TB/s, the default "
                 "500 W power limit, NVLink 8 per host, 400 Gb/s RDMA per GPU; tensor-core peaks the H100 SXM5 "
                 "datasheet's (989 TFLOPS bf16 dense)",
}
# the attention kernels a framework's time policy names: torch SDPA's flash backend (FlashAttention-2's
# kernels), FlexAttention's compiled Triton kernel, TransformerEngine's fused attention (cuDNN's fused
# flash attention on sm80 / sm90), the batched matmuls of an unfused attention (Megatron's local spec)
# and the CPU's SDPA math kernel (both at the GEMMs' rate: no entry in a profile)
ATTENTION_KERNELS = ("flash2", "flex", "te_fused", "unfused", "math")

_ATTENTION_SOURCES = (
    "attention_efficiency: FlashAttention-2 (Dao 2023, arXiv 2307.08691) reaches 50-73% of the A100's peak "
    "(0.70 forward, 0.60 backward assumed inside that range: its backward is the slower pass) and only 35% "
    "of the H100's (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608, which reaches 75% forward and "
    "runs its backward 1.5-1.75x faster than FlashAttention-2's); FlexAttention's kernel reaches 90% of "
    "FlashAttention-2's forward and 85% of its backward (PyTorch blog 'FlexAttention', Aug 2024); "
    "TransformerEngine's fused attention is taken as FlashAttention-2 on A100 and as FlashAttention-3 on "
    "Hopper (0.75 forward, 0.35 x 1.6 = 0.56 backward); B200: no source gives a figure (the GEMMs' used)")


def _attention(flash2: tuple, hopper_native: tuple | None = None) -> dict:
    """The kernels' (forward, backward) fractions from FlashAttention-2's on the device
    (_ATTENTION_SOURCES): FlexAttention 0.90 / 0.85 of it, TE's fused attention FlashAttention-2's or,
    on Hopper, FlashAttention-3's."""
    fwd, bwd = flash2
    return {"flash2": (fwd, bwd), "flex": (0.90 * fwd, 0.85 * bwd), "te_fused": hopper_native or (fwd, bwd)}


# what is assumed, not measured: a calibrate run on the device replaces each
_ASSUMED = ("gemm_efficiency: cuBLAS on large bf16 GEMMs reaches 70-80% of the dense peak on Hopper and "
            "Blackwell (public GEMM benchmarks; e.g. B200 cuBLAS 1,532-1,652 TFLOPS at 4096-8192 cubed) and "
            "~85% on A100; memory_efficiency 0.8 of HBM for streaming kernels; links: nccl-tests busbw "
            "~80% of the NVLink rate inside a node and ~90% of the NIC rate across nodes, ring-step latency "
            "~5 us (NVLink) / ~10 us (network): assumptions, not measurements")

# the host beside each GPU (ZeRO-Offload's time): (PCIe GB/s each way, host DRAM GB/s per GPU), from the
# datasheets: A100 SXM4 "PCIe Gen4: 64 GB/s" (32 each way), DGX A100's 2 x AMD EPYC 7742 with 8 channels of
# DDR4-3200 each (2 x 204.8 GB/s over 8 GPUs); H100 / H200 SXM "PCIe Gen5: 128 GB/s" (64 each way), DGX H100's
# 2 x Xeon Platinum 8480C with 8 channels of DDR5-4800 each (2 x 307.2 GB/s over 8 GPUs; HGX H200 and the
# Grand Teton H100 taken as the same host); DGX B200's PCIe Gen5 and 2 x Xeon Platinum 8570 with 8 channels of
# DDR5-5600 each (2 x 358.4 GB/s over 8 GPUs)
_HOSTS = {"a100": (32.0, 2 * 204.8 / 8), "h100": (64.0, 2 * 307.2 / 8), "h100-96gb": (64.0, 2 * 307.2 / 8),
          "h200": (64.0, 2 * 307.2 / 8), "b200": (64.0, 2 * 358.4 / 8)}
_HOST_SOURCES = ("host: the GPU datasheets' PCIe rates (A100 Gen4 32 GB/s each way; H100, H200, B200 Gen5 64) and "
                 "the DGX systems' CPUs' memory channels over 8 GPUs (DGX A100 2 x EPYC 7742 DDR4-3200: 51.2 GB/s a "
                 "GPU; DGX H100 2 x Xeon 8480C DDR5-4800: 76.8; DGX B200 2 x Xeon 8570 DDR5-5600: 89.6); the "
                 "link taken at its full rate and the host's memory at memory_efficiency: assumptions")


def _preset(name: str, peaks: dict, hbm_gbps: float, memory_gb: float, nvlink_each_way_gbps: float,
            nic_gbit: float, gemm_efficiency: float, sms: int, attention: dict) -> Profile:
    """A datasheet preset (_DATASHEET[name]) with the assumed fractions (_ASSUMED): NVLink busbw 80% of
    its one-way rate, the network 90% of one NIC per GPU, streaming kernels at 80% of HBM; the attention
    kernels' fractions (_ATTENTION_SOURCES)."""
    return Profile(name, peaks, hbm_gbps, memory_gb, 8, Link(0.8 * nvlink_each_way_gbps, 5.0),
                   Link(0.9 * nic_gbit / 8, 10.0), gemm_efficiency, 0.8, sms=sms, attention_efficiency=attention,
                   host_link_gbps=_HOSTS[name][0], host_memory_gbps=_HOSTS[name][1],
                   sources={"datasheet": _DATASHEET[name], "assumed": _ASSUMED, "attention": _ATTENTION_SOURCES,
                            "host": _HOST_SOURCES})


# NVIDIA H100 NVL datasheet: 1,671 TFLOPS bf16 with sparsity, 835 dense: the lower end of the Grand Teton
# H100's tensor-core peak (the h100-96gb preset's comment)
H100_NVL_BF16_TFLOPS = 835.0

_HOPPER_ATTENTION = _attention((0.35, 0.35), hopper_native=(0.75, 0.35 * 1.6))
PRESETS: dict[str, Profile] = {
    "a100": _preset("a100", {"bf16": 312.0, "fp32": 19.5, "tf32": 156.0}, 2039.0, 80.0, 300.0, 200.0, 0.85, 108,
                    _attention((0.70, 0.60))),
    "h100": _preset("h100", {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0}, 3350.0, 80.0, 450.0, 400.0, 0.75, 132,
                    _HOPPER_ATTENTION),
    # the torchtitan benchmarks' Grand Teton H100 (docs/performance.md): HBM2e at 2.4 TB/s, 96 GB, the
    # default 500 W power limit; the tensor cores' peak is the SXM5 datasheet's, the upper end of what its
    # source allows (benchmarks/llama3_h100_202412_torchtitan.md: "the actual peak TFLOPs number is
    # between SXM and NVL, and we don't know its exact value"; H100_NVL_BF16_TFLOPS the lower end)
    "h100-96gb": _preset("h100-96gb", {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0}, 2400.0, 96.0, 450.0, 400.0,
                         0.75, 132, _HOPPER_ATTENTION),
    "h200": _preset("h200", {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0}, 4800.0, 141.0, 450.0, 400.0, 0.75, 132,
                    _HOPPER_ATTENTION),
    "b200": _preset("b200", {"bf16": 2250.0, "fp8": 4500.0, "fp32": 75.0}, 8000.0, 180.0, 900.0, 400.0, 0.72, 148,
                    {}),
}


def profile(name: str, **overrides) -> Profile:
    """A preset by name with fields replaced (hardware.<field>=...); ConfigError naming the field."""
    if name not in PRESETS:
        raise ConfigError(f"hardware.name={name!r}: known profiles {sorted(PRESETS)} (or a calibrated yaml: "
                          "hardware.file=PATH)")
    return with_overrides(PRESETS[name], **overrides)


def with_overrides(p: Profile, **overrides) -> Profile:
    known = {f.name for f in dataclasses.fields(Profile)}
    links = {}
    for key in list(overrides):
        if key.startswith(("intra_", "inter_")):
            links[key] = overrides.pop(key)
    bad = sorted(set(overrides) - known)
    if bad:
        raise ConfigError(f"hardware.{bad[0]}: not a profile field (known: {sorted(known)})")
    for key, v in overrides.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0 and key not in ("kernel_overhead_s",):
            raise ConfigError(f"hardware.{key}={v}: must be > 0")
    p = dataclasses.replace(p, **overrides)
    for key, v in links.items():
        which, attr = key.split("_", 1)
        if attr not in ("busbw_gbps", "latency_us"):
            raise ConfigError(f"hardware.{key}: a link has busbw_gbps and latency_us")
        if not v > 0:
            raise ConfigError(f"hardware.{key}={v}: must be > 0")
        p = dataclasses.replace(p, **{which: dataclasses.replace(getattr(p, which), **{attr: float(v)})})
    if not 0 < p.gemm_efficiency <= 1 or not 0 < p.memory_efficiency <= 1:
        raise ConfigError(f"hardware: gemm_efficiency={p.gemm_efficiency} and memory_efficiency="
                          f"{p.memory_efficiency} are fractions in (0, 1]")
    return p


def from_dict(d: dict) -> Profile:
    """A profile from a calibrate yaml (its dict form)."""
    d = dict(d)
    try:
        intra, inter = Link(**d.pop("intra")), Link(**d.pop("inter"))
        table = tuple((tuple(k), float(v)) for k, v in d.pop("gemm_table", []))
        attention = {str(k): tuple(float(x) for x in v) for k, v in (d.pop("attention_efficiency", None) or {}).items()}
        bad = sorted(set(attention) - set(ATTENTION_KERNELS))
        if bad or any(len(v) != 2 or not all(0 < x <= 1 for x in v) for v in attention.values()):
            raise ConfigError(f"hardware.file: attention_efficiency maps a kernel of {list(ATTENTION_KERNELS)} to "
                              f"[forward, backward] fractions in (0, 1] (got {attention})")
        if "gemm_tile" in d:
            d["gemm_tile"] = tuple(int(x) for x in d["gemm_tile"])
        return with_overrides(Profile(intra=intra, inter=inter, gemm_table=table, attention_efficiency=attention, **d))
    except (TypeError, KeyError) as e:
        raise ConfigError(f"hardware.file: not a profile ({e})") from None


def to_dict(p: Profile) -> dict:
    d = dataclasses.asdict(p)
    d["gemm_table"] = [[list(k), v] for k, v in p.gemm_table]
    d["gemm_tile"] = list(p.gemm_tile)
    d["attention_efficiency"] = {k: list(v) for k, v in p.attention_efficiency.items()}
    return d

