"""Where an engine's device memory grows: a probe for ``engine_gpu.py`` (spec ``"memory_probe": true``).

Records torch's allocator history (Python stacks) from before the engine starts, and after every
model step (the worker's ``execute_model``, wrapped in this process) compares torch's peak
reserved bytes with the last step's: each growth of more than ``MIN_GROWTH`` is kept with the
step (tokens and rows scheduled) and the segments allocated since the last check, each with the
innermost frames of vLLM, kvlocks and Triton that asked for it. :func:`report` adds the growth
before the first step (engine start: profiling, KV cache, graph capture) and the allocator's
totals: what the memory test saves next to its figures.
"""

from __future__ import annotations

MIN_GROWTH = 32 << 20
MIN_SEGMENT = 8 << 20
KEEP = ("vllm/", "kvlocks", "triton/", "tests/vllm_gpu")


def _frames(frames: list) -> list[str]:
    out = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}" for f in frames
           if any(k in f.get("filename", "") for k in KEEP)]
    return out[:8]


class Probe:
    def __init__(self) -> None:
        import torch

        self.torch = torch
        torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
        self.last_time = 0
        self.peak = 0
        self.steps = 0
        self.growth: list[dict] = []

    def _new_segments(self) -> list[dict]:
        """Segments allocated (cudaMalloc) since the last call, largest first, with their stacks."""
        trace = self.torch.cuda.memory._snapshot()["device_traces"]
        events = [e for dev in trace for e in dev if e.get("time_us", 0) > self.last_time]
        if events:
            self.last_time = max(e.get("time_us", 0) for e in events)
        segs = [{"mib": round(e["size"] / 2**20, 1), "frames": _frames(e.get("frames", []))}
                for e in events if e["action"] == "segment_alloc" and e["size"] >= MIN_SEGMENT]
        frees = sum(e["size"] for e in events if e["action"] == "segment_free")
        segs.sort(key=lambda s: -s["mib"])
        return segs[:12] + ([{"freed_mib": round(frees / 2**20, 1)}] if frees else [])

    def check(self, where: str, **facts) -> None:
        peak = self.torch.cuda.max_memory_reserved()
        if peak > self.peak + MIN_GROWTH:
            self.growth.append({"where": where, "step": self.steps, **facts,
                                "peak_reserved_mib": round(peak / 2**20, 1),
                                "growth_mib": round((peak - self.peak) / 2**20, 1),
                                "peak_allocated_mib": round(self.torch.cuda.max_memory_allocated() / 2**20, 1),
                                "segments": self._new_segments()})
            self.peak = peak
        elif where == "step" and self.steps % 64 == 0:
            self._new_segments()  # move the window on: the next growth lists its own segments

    def wrap_runner(self) -> None:
        from vllm.v1.worker.gpu_worker import Worker  # vLLM 0.26 and 0.32: one per GPU, in this process

        cls = Worker
        original = cls.execute_model
        probe = self

        def execute_model(worker, scheduler_output, *args, **kwargs):
            out = original(worker, scheduler_output, *args, **kwargs)
            probe.steps += 1
            sched = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
            probe.check("step", tokens=int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0),
                        rows=len(sched), max_row_tokens=max(sched.values(), default=0))
            return out

        cls.execute_model = execute_model

    def report(self) -> dict:
        st = self.torch.cuda.memory_stats()
        self.torch.cuda.memory._record_memory_history(enabled=None)
        return {"growth": self.growth, "steps": self.steps,
                "reserved_mib": round(st.get("reserved_bytes.all.current", 0) / 2**20, 1),
                "allocated_mib": round(st.get("allocated_bytes.all.current", 0) / 2**20, 1),
                "inactive_split_mib": round(st.get("inactive_split_bytes.all.current", 0) / 2**20, 1),
                "num_alloc_retries": st.get("num_alloc_retries", 0)}
