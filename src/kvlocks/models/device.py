"""Check a device string before anything is loaded onto it."""

from __future__ import annotations

import torch


def check_device(device, *, name: str = "device") -> torch.device:
    """Return ``torch.device(device)`` if that device can be used here, else raise ``ValueError``.

    ``cpu`` always works; ``cuda`` and ``cuda:N`` need a visible CUDA device with index N
    (a CPU-only torch build sees none); any other type must allocate a tensor. ``name`` is how
    the message calls the argument (``"--device"`` from the CLI).
    """
    use_cpu = f"{name} cpu" if name.startswith("--") else f"{name}='cpu'"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"{name}={device!r} is not a device torch knows ({exc}); "
                         f"allowed: cpu, cuda, cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            why = (f"this torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
                   else "check the driver and CUDA_VISIBLE_DEVICES")
            raise ValueError(f"{name}={device!r}: no CUDA device is visible ({why}); use {use_cpu}")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"{name}={device!r}: only {count} CUDA device(s) visible "
                             f"(cuda:0 .. cuda:{count - 1}); use one of those or {use_cpu}")
        return dev
    try:
        torch.empty(0, device=dev)
    except Exception as exc:  # noqa: BLE001 - every backend raises its own type
        raise ValueError(f"{name}={device!r}: this torch cannot use a {dev.type!r} device "
                         f"({type(exc).__name__}: {exc}); use {use_cpu} or cuda") from None
    return dev
