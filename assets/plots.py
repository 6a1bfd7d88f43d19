"""The search's figures as PNG images (matplotlib, no display needed): throughput against TPOT with the
Pareto front, SLO attainment against request rate per variant, the cost model's prediction against the
measurement. Each function returns the PNG's bytes; the assets embed them and write them beside the report."""
from __future__ import annotations

import io


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the (throughput, latency) points no other point beats on both (higher throughput and lower
    latency, at least as good on each and better on one), in order of throughput."""
    front = [i for i, (x, y) in enumerate(points)
             if not any((x2 >= x and y2 <= y) and (x2 > x or y2 < y) for x2, y2 in points)]
    return sorted(front, key=lambda i: points[i][0])


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    ax.grid(True, alpha=0.3)
    return plt, fig, ax


def _png(plt, fig) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def throughput_vs_tpot(variants: list[tuple[str, float, float]], slo_tpot_ms: float | None = None) -> bytes:
    """``variants``: (name, output tok/s, TPOT p50 ms). The Pareto front joined by a line; the SLO's TPOT as a
    horizontal line when given."""
    plt, fig, ax = _figure()
    pts = [(x, y) for _, x, y in variants]
    for name, x, y in variants:
        ax.scatter([x], [y], s=36)
        ax.annotate(name[:32], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    front = pareto_front(pts)
    if len(front) > 1:
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "k--", lw=1, label="Pareto front")
    if slo_tpot_ms:
        ax.axhline(slo_tpot_ms, color="r", lw=1, label=f"SLO TPOT {slo_tpot_ms:.0f} ms")
    ax.set_xlabel("output tokens/s (slow tier)")
    ax.set_ylabel("TPOT p50 (ms)")
    ax.set_title("Throughput against time per output token")
    if len(front) > 1 or slo_tpot_ms:
        ax.legend(fontsize=8)
    return _png(plt, fig)


def attainment_vs_rate(variants: list[tuple[str, list[list[float]]]], target: float = 0.9) -> bytes:
    """``variants``: (name, [[rate req/s, attainment], ...]) from each capacity search; the target as a line."""
    plt, fig, ax = _figure()
    for name, probes in variants:
        pts = sorted((r, a) for r, a in probes)
        if pts:
            ax.plot([r for r, _ in pts], [a for _, a in pts], "o-", label=name[:40])
    ax.axhline(target, color="r", lw=1, ls="--", label=f"target {target:.0%}")
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.05)
    ax.set_xlabel("request rate (req/s, the slice's arrival pattern scaled)")
    ax.set_ylabel("requests within the SLO")
    ax.set_title("SLO attainment against request rate")
    ax.legend(fontsize=7)
    return _png(plt, fig)


def predicted_vs_measured(points: list[tuple[str, float, float]], what: str = "output tokens/s") -> bytes:
    """``points``: (name, predicted, measured); the diagonal is a perfect prediction."""
    plt, fig, ax = _figure()
    for name, p, m in points:
        ax.scatter([m], [p], s=36)
        ax.annotate(name[:32], (m, p), textcoords="offset points", xytext=(4, 4), fontsize=7)
    vals = [v for _, p, m in points for v in (p, m)] or [0.0, 1.0]
    lo, hi = min(vals), max(vals)
    pad = (hi - lo) * 0.1 or 1.0
    ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], "k:", lw=1, label="prediction = measurement")
    ax.set_xlabel(f"measured {what} (slow tier)")
    ax.set_ylabel(f"cost model's prediction ({what})")
    ax.set_title("Cost model against the measurement")
    ax.legend(fontsize=8)
    return _png(plt, fig)
