"""The ``opencl`` and ``opencl-adreno`` backends: the OpenCL devices of every platform, and opening one as an
OpenCLRuntime (runtime.py). Finding devices imports pyopencl; a missing one is BackendUnavailableError."""

from __future__ import annotations

from typing import Any

from perfx_core.backend import Backend, DeviceInfo
from perfx_core.errors import BackendError, BackendUnavailableError

from .runtime import OpenCLRuntime, device_state, load_pyopencl


def _cl_devices() -> list[tuple[Any, Any]]:
    """(platform, device) of every OpenCL device on every platform; BackendUnavailableError says why none."""
    cl = load_pyopencl()
    try:
        platforms = cl.get_platforms()
    except cl.Error as exc:
        raise BackendUnavailableError(
            f"no OpenCL platform ({exc}); install your GPU's OpenCL driver (ICD), or `pip install "
            "pocl-binary-distribution` for the CPU"
        ) from None
    found, reasons = [], []
    for platform in platforms:
        try:
            found.extend((platform, device) for device in platform.get_devices())
        except cl.Error as exc:
            reasons.append(f"{platform.name}: {exc}")
    if not found:
        raise BackendUnavailableError(
            "no OpenCL device on any platform" + (f" ({'; '.join(reasons)})" if reasons else "")
        )
    return found


def _is_adreno(device: Any) -> bool:
    return "qualcomm" in device.vendor.lower() or "adreno" in device.name.lower()


def _device_info(index: int, platform: Any, device: Any) -> DeviceInfo:
    cl = load_pyopencl()
    return DeviceInfo(
        index=index,
        name=f"{device.name.strip()} ({platform.name.strip()})",
        kind="gpu" if device.type & cl.device_type.GPU else "cpu",
        memory_bytes=int(device.global_mem_size),
        details={
            "vendor": device.vendor.strip(),
            "version": device.version.strip(),
            "driver": device.driver_version.strip(),
            "compute_units": int(device.max_compute_units),
            "max_work_group_size": int(device.max_work_group_size),
            "local_memory_bytes": int(device.local_mem_size),
            "cache_bytes": int(device.global_mem_cache_size),
            "image_support": bool(device.image_support),
            "fp16": "cl_khr_fp16" in device.extensions,
        },
    )


# -- the backends ----------------------------------------------------------------------------------------


class OpenCLBackend(Backend):
    name = "opencl"
    description = "OpenCL through pyopencl: any OpenCL 1.2+ device (GPUs first; PoCL runs it on the CPU)"
    variant = "generic"

    def devices(self) -> list[DeviceInfo]:
        return [_device_info(i, p, d) for i, (p, d) in enumerate(_cl_devices())]

    def _preference(self, found: list[tuple[Any, Any]]) -> list[int]:
        """Device indices to try when none is named: GPUs before the rest, in platform order."""
        cl = load_pyopencl()
        return sorted(range(len(found)), key=lambda i: not found[i][1].type & cl.device_type.GPU)

    def open(self, device: int | str | None = None) -> OpenCLRuntime:
        found = _cl_devices()
        infos = [_device_info(i, p, d) for i, (p, d) in enumerate(found)]
        if device is None:
            reasons = []
            for i in self._preference(found):
                try:
                    return self._open(i, found, infos)
                except BackendError as exc:  # e.g. a broken ICD: record why and try the next device
                    reasons.append(f"{infos[i].name}: {exc}")
            raise BackendUnavailableError("no OpenCL device could be opened: " + "; ".join(reasons))
        if isinstance(device, int) or (isinstance(device, str) and device.strip().isdigit()):
            index = int(device)
            if not 0 <= index < len(found):
                raise BackendError(f"{self.name} has devices 0..{len(found) - 1}; got {index} (see `perfx backends`)")
            return self._open(index, found, infos)
        matches = [i for i, info in enumerate(infos) if str(device).lower() in info.name.lower()]
        if not matches:
            names = ", ".join(f"{i}: {info.name}" for i, info in enumerate(infos))
            raise BackendError(f"no {self.name} device matches {device!r}; devices are {names}")
        return self._open(matches[0], found, infos)

    def _open(self, index: int, found: list[tuple[Any, Any]], infos: list[DeviceInfo]) -> OpenCLRuntime:
        platform, device = found[index]
        runtime = OpenCLRuntime(self.name, infos[index], device, device_state(index, platform, device), self.variant)
        # Building a tiny kernel now turns a device whose compiler cannot work (e.g. a PoCL whose LLVM does
        # not know the host CPU) into an error at open time, which auto-selection records and skips.
        runtime.build(_PROBE_SOURCE, label="probe.cl")
        return runtime


_PROBE_SOURCE = "__kernel void probe(__global float* x) { x[get_global_id(0)] = 1.0f; }\n"


class AdrenoBackend(OpenCLBackend):
    name = "opencl-adreno"
    description = (
        "OpenCL with Adreno kernel variants (texture reads of activations); picks a Qualcomm device, "
        "runs on any OpenCL device when forced"
    )
    variant = "adreno"

    def _preference(self, found: list[tuple[Any, Any]]) -> list[int]:
        generic = super()._preference(found)
        return sorted(generic, key=lambda i: not _is_adreno(found[i][1]))
