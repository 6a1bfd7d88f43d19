"""The reports' figures: the Pareto front, and PNGs that decode to images of the expected size."""
from __future__ import annotations

import io
import random

from PIL import Image

from assets.plots import attainment_vs_rate, pareto_front, predicted_vs_measured, throughput_vs_tpot


def _brute_front(points):
    def beaten(i):
        x, y = points[i]
        return any(x2 >= x and y2 <= y and (x2, y2) != (x, y) for x2, y2 in points)
    return sorted((i for i in range(len(points)) if not beaten(i)), key=lambda i: points[i][0])


def test_the_pareto_front_keeps_what_nothing_beats_on_both_axes():
    # (tok/s, TPOT ms): the 2nd is beaten by the 3rd (faster and lower latency); the 4th duplicates the 1st
    pts = [(10.0, 5.0), (12.0, 9.0), (14.0, 8.0), (10.0, 5.0), (20.0, 30.0)]
    assert pareto_front(pts) == [0, 3, 2, 4]
    rng = random.Random(7)
    for _ in range(50):  # against a brute force on fresh random points
        pts = [(rng.randint(1, 20) * 1.0, rng.randint(1, 20) * 1.0) for _ in range(rng.randint(1, 12))]
        assert pareto_front(pts) == _brute_front(pts)


def _image(png: bytes) -> Image.Image:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    img = Image.open(io.BytesIO(png))
    img.load()
    return img


def test_the_three_figures_are_pngs():
    a = _image(throughput_vs_tpot([("static-best", 15.5, 384.0), ("grid s4", 9.5, 250.0)], 405.0))
    b = _image(attainment_vs_rate([("static-best", [[0.4, 0.2], [0.2, 1.0], [0.28, 0.95]]), ("empty", [])]))
    c = _image(predicted_vs_measured([("static-best", 14.0, 15.5), ("grid s4", 10.2, 9.5)]))
    assert a.size == b.size == c.size == (640, 420)
    # something was drawn: more than a blank canvas's few colours
    assert all(len(img.convert("RGB").getcolors(1 << 16) or range(1 << 16)) > 50 for img in (a, b, c))
    _image(predicted_vs_measured([]))  # no points: an empty figure, not an error
