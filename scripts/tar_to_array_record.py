"""Converts webdataset tar shards (img2dataset layout) into ArrayRecord files.

    python scripts/tar_to_array_record.py --input 'shards/{00000..00009}.tar' --output DIR

One `DIR/NAME.array_record` (+ `NAME.stats.json`) per shard, written atomically: a killed run
never leaves a file that looks complete, and re-running converts only the shards not yet done.
Bad records (corrupt images, missing or non-UTF-8 captions, members without a partner, ...)
are dropped and counted; the totals are printed and saved in DIR/conversion_summary.json.
Train on the result with `data.source="array_record", data.path="DIR/*.array_record"`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, nargs="+",
                        help="shard paths, globs or brace patterns (local or fsspec URLs)")
    parser.add_argument("--output", required=True, help="output folder (local)")
    parser.add_argument("--workers", type=int, default=0,
                        help="parallel processes, one shard each (0: in this process)")
    parser.add_argument("--no-check-images", action="store_true",
                        help="skip the full image decode (faster; bad images are then only "
                             "caught at training time)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    from input_pipeline import convert_tar
    try:
        summary = convert_tar.convert(args.input, args.output, num_workers=args.workers,
                                      check_images=not args.no_check_images,
                                      progress=not args.no_progress)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    skipped = {k: v for k, v in summary["skipped"].items() if v}
    print(f"{summary['num_shards']} shards ({summary['resumed_shards']} already done), "
          f"{summary['written']} records written, {summary['skipped_total']} skipped"
          + (f": {json.dumps(skipped)}" if skipped else "")
          + f"\nsummary: {os.path.join(args.output, convert_tar.SUMMARY_FILE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
