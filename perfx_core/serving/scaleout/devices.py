"""Which device an engine replica opens, and what Ray reserves for it.

A replica that Ray gave a GPU (``num_gpus=1``) must open that GPU and no other. Ray says which through the
visibility variable of the GPU's runtime (``CUDA_VISIBLE_DEVICES`` for NVIDIA, ``ROCR_VISIBLE_DEVICES``/
``HIP_VISIBLE_DEVICES`` for AMD), set in the replica's process before perfx starts. NVIDIA's OpenCL driver
honours ``CUDA_VISIBLE_DEVICES``, so the replica then sees its one GPU. A driver that ignores it shows every GPU;
the replica then takes the GPU at the position of its Ray GPU id among the OpenCL GPUs (Ray numbers GPUs in the
order their runtime lists them, which for one vendor's identical cards is the PCI order OpenCL drivers use too).
Ray's ``GPU`` resource counts NVIDIA and AMD cards, so another vendor's GPU (an integrated one) is not a candidate
while there is one of theirs.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...backend import DeviceInfo

GPU_BACKENDS = ("opencl", "opencl-adreno")  # backends whose best device is a GPU where there is one
RAY_GPU_VENDORS = ("nvidia", "advanced micro devices", "amd")  # OpenCL vendor names of the cards Ray counts


def replica_device(devices: Sequence[DeviceInfo], ray_gpu_ids: Sequence[str | int]) -> int | None:
    """The device index a replica given ``ray_gpu_ids`` opens, among the backend's ``devices``; None: the
    backend's own choice (no GPU was reserved, or the backend shows no GPU)."""
    if not ray_gpu_ids:
        return None
    gpus = [d for d in devices if d.kind == "gpu"]
    ray_counted = [d for d in gpus if str(d.details.get("vendor", "")).lower().startswith(RAY_GPU_VENDORS)]
    gpus = [d.index for d in (ray_counted or gpus)]
    if not gpus:
        return None
    if len(gpus) <= len(ray_gpu_ids):  # the driver shows only this replica's GPUs
        return gpus[0]
    position = int(ray_gpu_ids[0])
    return gpus[position] if position < len(gpus) else gpus[0]


def replica_gpus(backend: str, cluster_gpus: float, requested: float | None) -> float:
    """GPUs reserved per replica: ``requested`` if given, else one where the backend runs on GPUs and the cluster
    has some, else none (the replica then takes CPUs only)."""
    if requested is not None:
        return requested
    return 1.0 if backend in GPU_BACKENDS and cluster_gpus >= 1 else 0.0
