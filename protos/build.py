"""Generate the Python gRPC stubs (`*_pb2.py`, `*_pb2_grpc.py`, `*_pb2.pyi`) for protos/.

`python -m protos.build` writes them next to the .proto files; `build(out_dir)` writes them under
another root (tests compare the two to catch stale stubs). The proto path is the repository root,
so generated imports are package-qualified: `from protos.specdecode.v1 import specdecode_pb2`.
"""

from __future__ import annotations

import argparse
import importlib.resources
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = ("protos/specdecode/v1/specdecode.proto",)
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def generated_files(proto: str) -> list[str]:
    """Paths (relative to the output root) that protoc writes for one .proto file."""
    stem = proto.removesuffix(".proto")
    return [stem + suffix for suffix in GENERATED_SUFFIXES]


def build(out_dir: Path | str = REPO_ROOT) -> list[Path]:
    """Run protoc (grpcio-tools) on every proto file; return the generated paths."""
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    written: list[Path] = []
    for proto in PROTO_FILES:
        (out_dir / proto).parent.mkdir(parents=True, exist_ok=True)
        argv = [
            "grpc_tools.protoc",
            f"-I{REPO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(REPO_ROOT / proto),
        ]
        rc = protoc.main(argv)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc} on {proto}")
        written.extend(out_dir / path for path in generated_files(proto))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO_ROOT), help="output root (default: the repository root)")
    args = parser.parse_args(argv)
    for path in build(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
