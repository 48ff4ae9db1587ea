"""The demo's table, JSON summary and PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def summarize(name: str, run: dict[str, Any], standard_rate: float | None) -> dict[str, Any]:
    """One method's row: throughput, padding, samples per update, updates and the final loss.

    ``final_loss`` is the final model's per-token loss over a fixed probe of training samples
    (the same for every method, so all are compared after the same samples seen);
    ``tail_loss`` is the token-weighted mean training loss over the last 10% of samples seen.
    """
    log = run["log"]
    updates = len(log)
    cutoff = 0.9 * run["samples"]
    tail = [e for e in log if e["samples"] > cutoff] or log[-1:]
    tail_tokens = sum(e["tokens"] for e in tail)
    tail_loss = sum(e["loss"] * e["tokens"] for e in tail) / max(tail_tokens, 1)
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
        "speedup_vs_standard": rate / standard_rate if standard_rate else 1.0,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the rows."""
    head = ("| method | samples/s | tokens/s | padding | samples/update | updates | final loss | speedup vs Standard |\n"
            "|---|---|---|---|---|---|---|---|")
    lines = [f"| {r['name']} | {r['samples_per_second']:.1f} | {r['tokens_per_second']:.0f} | "
             f"{r['padding_fraction']:.1%} | {r['samples_per_update']:.1f} | {r['updates']} | "
             f"{r['final_loss']:.3f} | {r['speedup_vs_standard']:.2f}x |" for r in rows]
    return "\n".join([head, *lines])


def plot(runs: dict[str, dict[str, Any]], rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """loss_vs_samples.png and padding_vs_throughput.png in ``out_dir``."""
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
    return [loss_png, pad_png]
