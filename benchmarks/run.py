"""One command for every benchmark: ``python benchmarks/run.py [--quick] [--only core ...]``.

Each section prints its table and a few same-run ratios; the summary repeats the ratios.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# section -> module; each is imported only when it runs, so ``--only gpu`` needs no S3 stack
SECTIONS = {
    "core": "bench_core",
    "columns": "bench_columns",
    "async": "bench_async",
    "fully_parallel": "bench_fully_parallel",
    "planning": "bench_planning",
    "s3": "bench_s3",
    "gpu": "bench_gpu",
    "data": "bench_data",
    "writer": "bench_writer",
    "local": "bench_local",
    "hf": "bench_hf",
    "incremental": "bench_incremental",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--repeats", type=int, default=3, help="alternated runs per contender")
    parser.add_argument("--only", nargs="*", choices=sorted(SECTIONS), help="sections to run")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="dcpb-bench-")
    summary: list[str] = []
    try:
        for name in args.only or SECTIONS:
            section = importlib.import_module(f"benchmarks.{SECTIONS[name]}")
            summary += section.main(root, args.repeats, args.quick)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(
        "\n## summary (same-run ratios, medians of alternated runs; >1 means dcpbridge is faster)"
    )
    for line in summary:
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
