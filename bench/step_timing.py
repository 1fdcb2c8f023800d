"""The measurement both training-step drivers share (ours in the project venv, speculators' in its own
venv, which cannot import eagle3_hf): warm-up, timed steps, step-only peak RSS, an optional profile."""

from __future__ import annotations

import time


def rss_mib(field: str) -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure_steps(step, rows: dict, spec: dict) -> tuple[list[float], float, str | None]:
    """Run `step(list of one-row batches)` as spec says -> (step seconds, peak MiB over the steps, profile)."""
    num_rows = rows["input_ids"].shape[0]
    full = [{k: v[r : r + 1] for k, v in rows.items()} for r in range(num_rows)]
    for _ in range(spec["warmup"]):  # the AdamW state and first-call work, on a short slice of one row
        step([{k: v[:1, : spec["warmup_tokens"]] for k, v in rows.items()}])
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here on: the training steps only
    times = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        step(full)
        times.append(time.perf_counter() - t0)
    peak_step = rss_mib("VmHWM")
    profile = None
    if spec.get("profile"):
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            step(full)
        profile = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=spec["profile"])
    return times, peak_step, profile
