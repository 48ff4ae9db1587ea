"""The demo's table, JSON summary and PNG plots.

**Time to loss** (issue 19): a method's training loss curve is smoothed as the
token-weighted mean of the per-update training losses over a trailing window of the
last 10% of its samples (:func:`smoothed`: at the update that brings samples seen to
``s``, the updates ending in ``(s - 0.1 N, s]``, ``N`` the run's samples; a point only
once ``s >= 0.1 N``). Standard's final loss is the last point of its smoothed curve
(its ``tail_loss``), and a method's time to it is the wall-clock seconds, from the start
of its epoch, at the end of the first update whose smoothed loss is at or below it
(``None``: not reached in the epoch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

WINDOW = 0.1  # the smoothing window: the last 10% of a run's samples


def smoothed(run: dict[str, Any]) -> list[tuple[float, int, float]]:
    """(seconds, samples seen, smoothed training loss) at every update with at least a
    window's samples behind it (see the module); the last point's loss is ``tail_loss``."""
    log = run["log"]
    width = WINDOW * run["samples"]
    out = []
    for k, entry in enumerate(log):
        if entry["samples"] < width and k < len(log) - 1:
            continue
        window = [e for e in log[: k + 1] if e["samples"] > entry["samples"] - width] or [entry]
        tokens = sum(e["tokens"] for e in window)
        out.append((entry.get("seconds", float("nan")), entry["samples"],
                    sum(e["loss"] * e["tokens"] for e in window) / max(tokens, 1)))
    return out


def time_to_loss(run: dict[str, Any], target: float | None) -> float | None:
    """Seconds until the smoothed training loss first reaches ``target`` (None: never, or no target)."""
    if target is None:
        return None
    return next((sec for sec, _, loss in smoothed(run) if loss <= target), None)


def summarize(name: str, run: dict[str, Any], standard_rate: float | None,
              target: float | None = None) -> dict[str, Any]:
    """One method's row: throughput, padding, samples per update, updates and the final loss.

    ``final_loss`` is the final model's per-token loss over a fixed probe of training samples
    (the same for every method, so all are compared after the same samples seen);
    ``tail_loss`` is the token-weighted mean training loss over the last 10% of samples seen
    (the last point of :func:`smoothed`); ``time_to_standard_loss``: :func:`time_to_loss` of ``target``.
    """
    log = run["log"]
    updates = len(log)
    tail_loss = smoothed(run)[-1][2]
    rate = run["samples"] / run["seconds"]
    return {
        "name": name,
        "samples": run["samples"],
        "seconds": round(run["seconds"], 2),
        "samples_per_second": rate,
        "tokens_per_second": run["real_tokens"] / run["seconds"],
        "padding_fraction": 1 - run["real_tokens"] / max(run["padded_tokens"], 1),
        "samples_per_update": run["samples"] / max(updates, 1),
        "updates": updates,
        "final_loss": run["final_loss"],
        "tail_loss": tail_loss,
        "time_to_standard_loss": time_to_loss(run, target),
        "speedup_vs_standard": rate / standard_rate if standard_rate else 1.0,
    }


def label(name: str, config: dict[str, Any] | None = None) -> str:
    """A method's name as the table shows it: Standard, Sorted, ODB and ODB packed, the ODB rows
    with their micro-batches per update and tokens per micro-batch when ``config`` (the summary's)
    is given."""
    names = {"standard": "Standard", "sorted": "Sorted", "odb": "ODB", "odb-packed": "ODB packed"}
    shown = names.get(name, name)
    if config is None or name not in ("odb", "odb-packed"):
        return shown
    micro = config["token_budget"] // config["accumulation_steps"]
    if name == "odb":
        return f"{shown} ({config['accumulation_steps']} x {micro:,} tokens per rank per update)"
    return f"{shown} ({config['packed_accumulation_steps']} x {micro:,} real tokens per rank per update)"


def table(rows: list[dict[str, Any]], target: float | None = None, config: dict[str, Any] | None = None) -> str:
    """A Markdown table of the rows (README's demo table is a copy of one): Standard's final smoothed
    loss ``target`` in the last column's header, each time to it with the method's epoch seconds."""
    last = "time to Standard's loss" + ("" if target is None else f" ({target:.3f})")
    head = (f"| method | samples/s | tokens/s | padding | samples/update | updates | final loss | {last} |\n"
            "|---|---|---|---|---|---|---|---|")
    lines = [f"| {label(r['name'], config)} | {r['samples_per_second']:.1f} | {r['tokens_per_second']:,.0f} | "
             f"{r['padding_fraction']:.1%} | {r['samples_per_update']:.1f} | {r['updates']} | "
             f"{r['final_loss']:.3f} | {_time_to_loss(r)} |"
             for r in rows]
    return "\n".join([head, *lines])


def speedups(rows: list[dict[str, Any]]) -> str:
    """One line: each method's samples/s against Standard's (``speedup_vs_standard``)."""
    return "samples/s against Standard's: " + ", ".join(
        f"{label(r['name'])} {r['speedup_vs_standard']:.2f}x" for r in rows if r["name"] != "standard")


def _time_to_loss(row: dict[str, Any]) -> str:
    reached = row.get("time_to_standard_loss")
    return "not reached" if reached is None else f"{reached:.1f} s (of {row['seconds']:.1f} s)"


def plot_time(runs: dict[str, dict[str, Any]], target: float | None, out_dir: Path) -> Path:
    """loss_vs_seconds.png: every method's smoothed training loss (:func:`smoothed`)
    against wall-clock seconds, with Standard's final smoothed loss as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in runs.items():
        points = smoothed(run)
        ax.plot([p[0] for p in points], [p[2] for p in points], label=name, linewidth=1.2)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=0.8, label="Standard's final loss")
    ax.set_xlabel("wall-clock seconds")
    ax.set_ylabel(f"training loss (per token, trailing {WINDOW:.0%} of samples)")
    ax.set_title("Loss against time")
    ax.legend()
    fig.tight_layout()
    png = out_dir / "loss_vs_seconds.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def plot(runs: dict[str, dict[str, Any]], rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """loss_vs_samples.png and padding_vs_throughput.png in ``out_dir``; loss_vs_seconds.png (:func:`plot_time`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in runs.items():
        xs = [e["samples"] for e in run["log"]]
        ys = [e["loss"] for e in run["log"]]
        ax.plot(xs, ys, label=name, linewidth=1.2)
    ax.set_xlabel("samples seen")
    ax.set_ylabel("training loss (per token)")
    ax.set_title("Loss against samples seen")
    ax.legend()
    fig.tight_layout()
    loss_png = out_dir / "loss_vs_samples.png"
    fig.savefig(loss_png, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for r in rows:
        ax.scatter(100 * r["padding_fraction"], r["samples_per_second"], s=60)
        ax.annotate(r["name"], (100 * r["padding_fraction"], r["samples_per_second"]),
                    textcoords="offset points", xytext=(6, 4))
    ax.set_xlabel("padding (% of processed tokens)")
    ax.set_ylabel("samples / s")
    ax.set_title("Padding against throughput")
    fig.tight_layout()
    pad_png = out_dir / "padding_vs_throughput.png"
    fig.savefig(pad_png, dpi=120)
    plt.close(fig)
    standard = runs.get("standard")
    return [loss_png, pad_png, plot_time(runs, smoothed(standard)[-1][2] if standard else None, out_dir)]
