"""The plots of docs/benchmarks.md: v1's engine summary (RTF, throughput, first audio) and a listener plot per family."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _setup(r: dict[str, Any]) -> str:
    return str(r.get("label") or f"int8, {r['n_timesteps']} steps")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def summary_plot(results: dict[str, Any], path: Path) -> None:
    """v1: single-stream RTF per bundle, and audio seconds per wall second and first audio against concurrent streams."""
    from matplotlib.ticker import ScalarFormatter

    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    labels, rtfs = [], []
    if results.get("reference"):
        labels.append("torch ref")
        rtfs.append(results["reference"]["median"]["rtf"])
    for r in results.get("single", []):
        labels.append(f"{r['label']}/{r['n_timesteps']}")
        rtfs.append(r["median"]["rtf"])
    axes[0].bar(labels, rtfs, color=["#999"] + ["#3a7"] * (len(rtfs) - 1) if results.get("reference") else "#3a7")
    axes[0].set_yscale("log")
    axes[0].yaxis.set_major_formatter(ScalarFormatter())
    axes[0].yaxis.set_minor_formatter(ScalarFormatter())
    axes[0].axhline(1.0, color="k", lw=0.8, ls="--")
    axes[0].set_title("single stream RTF (lower is better)")
    axes[0].tick_params(axis="x", rotation=45)
    series = [(f"in-process {_setup(r).removeprefix('int8, ')}", r["levels"]) for r in results.get("concurrency", [])]
    if results.get("http"):
        series.append(("HTTP 10 steps", results["http"]["levels"]))
    for name, levels in series:
        clients = [lv["clients"] for lv in levels]
        axes[1].plot(clients, [lv["audio_per_wall"] for lv in levels], marker="o", label=name)
        axes[2].plot(clients, [lv["first_chunk_p95_s"] for lv in levels], marker="o", label=f"{name} p95")
        axes[2].plot(clients, [lv["first_chunk_p50_s"] for lv in levels], marker=".", ls=":", label=f"{name} p50")
    axes[1].axhline(1.0, color="k", lw=0.8, ls="--")
    axes[1].set(title="aggregate audio s per wall s (int8)", xlabel="concurrent streams")
    axes[2].axhline(3.0, color="k", lw=0.8, ls="--")
    axes[2].set(title="first audio latency s (int8)", xlabel="concurrent streams")
    for ax in axes[1:]:
        ax.set_xscale("log", base=2)
        ax.set_xticks([lv["clients"] for lv in series[0][1]] if series else [1])
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def listener_plot(part: dict[str, Any], title: str, path: Path) -> None:
    """One family's default-settings listener rows: first audio and TTCA (p50) per voice against concurrent clients."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = part["default"]["rows"]
    for voice in dict.fromkeys(r["voice"] for r in rows):
        mine = [r for r in rows if r["voice"] == voice]
        clients = [r["clients"] for r in mine]
        axes[0].plot(clients, [r["first_audio_s_p50"] for r in mine], marker="o", label=voice)
        axes[1].plot(clients, [r["ttca_s_p50"] for r in mine], marker="o", label=voice)
    axes[0].set(title=f"{title}: first audio p50 (s)", xlabel="concurrent clients")
    axes[1].set(title=f"{title}: TTCA p50 (s)", xlabel="concurrent clients")
    for ax in axes:
        ax.set_xticks(sorted({r["clients"] for r in rows}))
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
