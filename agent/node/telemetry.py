"""Node telemetry: GPUs through NVML when present, CPU and memory through psutil, and the
trainer's progress. Sampled about once a second and published at QoS 0.

A node without a GPU (or without the NVIDIA driver) is normal here: NVML failing to load is
logged once and the node reports no GPUs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import psutil

from agent.node.trainer_channel import TrainerProgress
from fleetd.protocol.messages import GpuSample, Telemetry
from fleetd.shared.logs import get_logger

log = get_logger(__name__)


class GpuProbe:
    """NVML wrapper. ``available`` is False when there is no driver or no device."""

    def __init__(self) -> None:
        self._nvml = None
        self._handles: list[object] = []
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._nvml = pynvml
            log.info("nvml_ready", gpus=count)
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError...
            log.info("nvml_unavailable", reason=str(exc) or type(exc).__name__)

    @property
    def available(self) -> bool:
        return self._nvml is not None and bool(self._handles)

    def sample(self) -> tuple[GpuSample, ...]:
        """Blocking NVML calls (milliseconds): call through asyncio.to_thread."""
        if self._nvml is None:
            return ()
        nvml = self._nvml
        out = []
        for index, handle in enumerate(self._handles):
            try:
                util = nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            except nvml.NVMLError as exc:
                # One GPU falling off the bus must not stop telemetry for the rest.
                log.warning("nvml_sample_failed", gpu=index, error=str(exc))
                continue
            out.append(
                GpuSample(
                    index=index,
                    util_pct=float(min(max(util.gpu, 0), 100)),
                    mem_used_mib=mem.used / 2**20,
                    mem_total_mib=mem.total / 2**20,
                )
            )
        return tuple(out)

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._nvml = None


def _clamp_pct(value: float) -> float:
    return float(min(max(value, 0.0), 100.0))


def sample_telemetry(instance_id: str, gpus: tuple[GpuSample, ...], trainer: TrainerProgress) -> Telemetry:
    # cpu_percent(interval=None) compares with the previous call: non-blocking, ~1 s window here.
    return Telemetry(
        instance_id=instance_id,
        gpus=gpus,
        cpu_pct=_clamp_pct(psutil.cpu_percent(interval=None)),
        mem_used_pct=_clamp_pct(psutil.virtual_memory().percent),
        step=trainer.step,
        steps_per_s=trainer.steps_per_s,
        world_size=trainer.world_size,
    )


class TelemetryLoop:
    """Every ``interval_s``: sample, then hand the Telemetry to ``publish`` (QoS 0)."""

    def __init__(
        self,
        instance_id: str,
        publish: Callable[[Telemetry], Awaitable[None]],
        trainer_progress: Callable[[], TrainerProgress],
        *,
        interval_s: float = 1.0,
        probe: GpuProbe | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.publish = publish
        self.trainer_progress = trainer_progress
        self.interval_s = interval_s
        self.probe = probe
        self.samples = 0

    async def run(self) -> None:
        probe = self.probe
        if probe is None:
            probe = await asyncio.to_thread(GpuProbe)
        psutil.cpu_percent(interval=None)  # prime the CPU counter
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                gpus = await asyncio.to_thread(probe.sample) if probe.available else ()
                telemetry = sample_telemetry(self.instance_id, gpus, self.trainer_progress())
                self.samples += 1
                await self.publish(telemetry)
        finally:
            if self.probe is None:
                probe.close()
