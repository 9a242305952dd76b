"""PNG figures of a bench run (matplotlib, Agg backend: no display needed).

Why: a table gives medians; a tuning decision needs the shape of a distribution and the trade-off
between time the scheduler blocks and steps requests are deferred, mode by mode.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator


def _cdf(ax: Any, values_s: Sequence[float], label: str) -> None:
    xs = sorted(v * 1e6 for v in values_s)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def latency_plot(raw: dict[str, dict[str, list[float]]], path: str) -> str:
    """CDFs of the scheduler-path cost of one call (scenario a): blocking calls and async first calls."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, series in raw.items():  # a floor has one series only
        _cdf(axes[0], series.get("sync", []), name)
        _cdf(axes[1], series.get("async_first", []), name)
    for ax, title in zip(axes, ("blocking lookup call (sync)", "first non-blocking call (async)"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("microseconds on the scheduler's thread")
        ax.set_ylabel("fraction of calls")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def modes_plot(modes: Sequence[dict[str, Any]], path: str) -> str:
    """Scheduler blocked time vs deferred steps, one point per mode (scenario c)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for m in modes:
        x = m["mean_deferred_steps"]
        axes[0].scatter(x, m["call_us"].get("p99", 0), s=40)
        axes[0].annotate(m["label"], (x, m["call_us"].get("p99", 0)), fontsize=8, xytext=(4, 4),
                         textcoords="offset points")
        axes[1].scatter(x, m["blocked_per_step_us"].get("mean", 0), s=40)
        axes[1].annotate(m["label"], (x, m["blocked_per_step_us"].get("mean", 0)), fontsize=8, xytext=(4, 4),
                         textcoords="offset points")
    axes[0].set_ylabel("p99 of one lookup call (us)")
    axes[1].set_ylabel("mean lookup time per scheduler step (us)")
    for ax in axes:
        ax.set_yscale("log")
        ax.set_xlabel("mean deferred steps per request")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("vLLM scheduler: time blocked vs deferrals, per lookup mode")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def burst_plot(burst: dict[str, Any], path: str) -> str:
    """Time until every answer of a burst is ready, per client (scenario b)."""
    names = [k for k in burst if isinstance(burst[k], dict)]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, [burst[n]["seconds"] * 1e3 for n in names])
    ax.set_ylabel("ms until all answers")
    ax.set_title(f"burst of {burst['n']} new requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def per_step_plot(a4: dict[str, Any], path: str) -> str:
    """Cost per lookup on the scheduler's thread against lookups arriving per step, per client (scenario a4)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ks = a4["ks"]
    for name, per_k in a4["clients"].items():
        ax.plot(ks, [per_k[str(k)]["per_lookup_us"]["p50"] for k in ks], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("lookups arriving in one step (k)")
    ax.set_ylabel("us per lookup on the scheduler's thread (p50)")
    ax.set_title("k lookups per step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def long_prompts_plot(f: dict[str, Any], path: str) -> str:
    """Per-call cost, mean ``schedule()`` time and time to answer against prompt length (scenario f)."""
    lengths = f["lengths"]
    blocks = [length["blocks"] for length in lengths]
    panels = (("call_us", "mean", "lookup call, mean (us)"), ("schedule_us", "mean", "schedule() per step, mean (us)"),
              ("answer_delay_us", "p50", "arrival to answer, p50 (us)"))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for label in lengths[0]["modes"]:
        for ax, (key, stat, _) in zip(axes, panels):
            ax.plot(blocks, [length["modes"][label][key].get(stat, float("nan")) for length in lengths], marker="o",
                    label=label)
    for ax, (_, _, title) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt length (blocks of 16 tokens)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("vLLM scheduler, both async: prompt length")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def multi_turn_plot(g: dict[str, Any], path: str) -> str:
    """Per turn, both clients: store keys per lookup and time to answer (sync), every shape (scenario g)."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    for backend, shapes in g["backends"].items():
        for entry in shapes:
            tag = f"{backend}, {entry['shape']['context_blocks']}-block context"
            for label in ("upstream sync", "ours sync"):
                turns = entry["runs"][label]["turns"]
                xs = [t["turn"] for t in turns]
                axes[0].plot(xs, [t["keys_per_lookup"] for t in turns], marker="o", label=f"{label}: {tag}")
                axes[1].plot(xs, [t["path_us"].get("p50", float("nan")) for t in turns], marker="o",
                             label=f"{label}: {tag}")
    for ax, title in zip(axes, ("store keys per lookup (counted at the store client)",
                                "time to answer, sync, p50 (us)"), strict=True):
        ax.set_yscale("log")
        ax.set_xlabel("turn")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7)
    fig.suptitle("vLLM scheduler: multi-turn conversations")
    fig.tight_layout(rect=(0, 0.04 + 0.03 * ((len(labels) + 1) // 2), 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def fleet_plot(h: dict[str, Any], path: str) -> str:
    """Scenario (h): the master's CPU per 1,000 lookups and the lookup p99 against N, per workload and client."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for kind in h["summary"]:
        for client in ("upstream", "ours"):
            mine = [p for p in h["phases"] if p["workload"] == kind and p["client"] == client]
            ns = [p["n"] for p in mine]
            label = f"{kind}, {client}"
            axes[0].plot(ns, [p["master"]["per_1000_ms"] or float("nan") for p in mine], marker="o", label=label)
            axes[1].plot(ns, [p["delay_ms"]["p99"] for p in mine], marker="o", label=label)
    axes[0].set_ylabel("master CPU ms per 1,000 lookups")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("arrival to answer, p99 (ms)")
    for ax in axes:
        ax.set_xlabel("engines on the master (N)")
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle("a fleet on one Mooncake master")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_all(results: dict[str, Any], raw_latency: dict[str, Any], out_dir: str) -> list[str]:
    """Every figure of a bench run into ``out_dir``; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [latency_plot(raw_latency, os.path.join(out_dir, "latency.png"))] if raw_latency else []
    if "c" in results:
        paths.append(modes_plot(results["c"]["modes"], os.path.join(out_dir, "modes.png")))
    if "b" in results:
        paths.append(burst_plot(results["b"], os.path.join(out_dir, "burst.png")))
    if "a4" in results:
        paths.append(per_step_plot(results["a4"], os.path.join(out_dir, "per_step.png")))
    if "f" in results:
        paths.append(long_prompts_plot(results["f"], os.path.join(out_dir, "long_prompts.png")))
    if "g" in results:
        paths.append(multi_turn_plot(results["g"], os.path.join(out_dir, "multi_turn.png")))
    if "h" in results:
        paths.append(fleet_plot(results["h"], os.path.join(out_dir, "fleet.png")))
    return paths


__all__ = ["burst_plot", "fleet_plot", "latency_plot", "long_prompts_plot", "modes_plot", "multi_turn_plot",
           "per_step_plot",
           "write_all"]
