#!/usr/bin/env python
"""How responsive the explore page is on a real store: time to the grid, time to render a
clicked head, time to re-render at another N, and the folder's sizes.

    python benchmarks/explore_page.py --store /tmp/exp-real.zarr --out /tmp/exp-page \\
        --screenshot docs/explore.png

Writes the page with ``attngeom.explore.explore``, opens it from disk in headless Chromium
(the Debian package, driven by playwright), loads the page ``--reps`` times and, once
plotly.js has loaded behind the grid, clicks ``--heads`` heads spread over the grid. Reports medians over
repetitions, and the ratio of a head's render time to the page's start (a head must cost no
more than a fraction of loading the page, whatever the number of heads).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from attngeom.api import explore


def folder_sizes(out: Path) -> dict[str, float]:
    files = [p for p in out.rglob("*") if p.is_file()]
    heads = sorted(p.stat().st_size for p in files if p.name.startswith("head_"))
    return {
        "total_mib": sum(p.stat().st_size for p in files) / 2**20,
        "files": len(files),
        "head_files": len(heads),
        "head_file_kib_median": statistics.median(heads) / 2**10,
        "head_file_kib_max": heads[-1] / 2**10,
        "index_js_kib": (out / "data" / "index.js").stat().st_size / 2**10,
        "plotly_kib": (out / "plotly.min.js").stat().st_size / 2**10,
    }


def measure(index: Path, reps: int, n_heads: int, screenshot: Path | None, show: tuple[int, int]) -> dict[str, object]:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    start_ms, fcp_ms, plotly_ms, click_ms, n_ms, cells, errors = [], [], [], [], [], [], []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        for rep in range(reps):
            tab = browser.new_page(viewport={"width": 1500, "height": 1050})
            tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            t0 = time.perf_counter()
            tab.goto(index.resolve().as_uri(), wait_until="commit")
            tab.wait_for_selector("body[data-ready='1']")
            start_ms.append(1000 * (time.perf_counter() - t0))
            tab.wait_for_function("() => window.Plotly !== undefined")
            plotly_ms.append(1000 * (time.perf_counter() - t0))
            fcp_ms.append(tab.evaluate(
                "() => (performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime || null"))
            layers, heads = tab.evaluate(
                "() => { const c = [...document.querySelectorAll('#head-grid [data-layer]')];"
                " return [new Set(c.map(x => x.dataset.layer)).size, new Set(c.map(x => x.dataset.head)).size]; }")
            cells.append(tab.locator("#head-grid [data-layer]").count())
            picks = [(int(i * (layers - 1) / max(n_heads - 1, 1)), (7 * i + rep) % heads) for i in range(n_heads)]
            for layer, head in picks:
                t0 = time.perf_counter()
                tab.click(f"#head-grid [data-layer='{layer}'][data-head='{head}']")
                tab.wait_for_selector(f"#head-view[data-rendered='{layer}_{head}']")
                tab.evaluate("() => new Promise(r => requestAnimationFrame(() => r()))")
                click_ms.append(1000 * (time.perf_counter() - t0))
            for label in ("16", "4"):
                t0 = time.perf_counter()
                tab.select_option("#n-select", label=label)
                tab.evaluate("() => new Promise(r => requestAnimationFrame(() => r()))")
                n_ms.append(1000 * (time.perf_counter() - t0))
            if screenshot is not None and rep == reps - 1:
                tab.set_viewport_size({"width": 1400, "height": 1330})
                tab.select_option("#n-select", label="8")
                tab.click(f"#head-grid [data-layer='{show[0]}'][data-head='{show[1]}']")
                tab.wait_for_selector(f"#head-view[data-rendered='{show[0]}_{show[1]}']")
                tab.wait_for_timeout(500)
                tab.screenshot(path=str(screenshot))
            tab.close()
        browser.close()
    return {
        "grid_cells": sorted(set(cells)),
        "page_start_ms_median": statistics.median(start_ms),
        "first_contentful_paint_ms_median": statistics.median(x for x in fcp_ms if x is not None),
        "plotly_loaded_ms_median": statistics.median(plotly_ms),
        "head_render_ms_median": statistics.median(click_ms),
        "head_render_ms_max": max(click_ms),
        "n_change_ms_median": statistics.median(n_ms),
        "head_render_over_page_start": statistics.median(click_ms) / statistics.median(start_ms),
        "clicks": len(click_ms),
        "console_errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--run")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--heads", type=int, default=8, help="heads clicked per repetition")
    parser.add_argument("--screenshot", type=Path, help="PNG of the page with the head --show open")
    parser.add_argument("--show", default="3.0", help="LAYER.HEAD shown in the screenshot")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    result = explore(args.store, args.out, run_id=args.run, sequences=args.sequences)
    report = {"explore_s": result.seconds, "heads": result.heads, **folder_sizes(args.out),
              **measure(result.index, args.reps, args.heads, args.screenshot,
                      tuple(int(x) for x in args.show.split(".")))}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
