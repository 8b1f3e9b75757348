"""Regenerate pdcluster/_proto/ from proto/pdcluster/v1/*.proto (stubs are committed).

tests/test_proto_stubs.py regenerates into a temp dir and fails when the committed stubs differ.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "pdcluster" / "_proto"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compile every .proto into flat modules in out_dir and fix imports to be package-relative."""
    import grpc_tools
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTO_DIR.glob("pdcluster/v1/*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    import tempfile

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="pdcluster-proto-"))  # private: safe to run concurrently
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={tmp}", f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}"] + [str(p) for p in protos]
    if protos and protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for f in sorted((tmp / "pdcluster" / "v1").glob("*")) if protos else []:
        text = f.read_text()
        # protoc emits absolute imports (`from pdcluster.v1 import x_pb2`); our stubs live in
        # pdcluster._proto, so rewrite them to relative imports.
        text = text.replace("from pdcluster.v1 import", "from . import")
        dst = out_dir / f.name
        dst.write_text(text)
        written.append(dst)
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return written


if __name__ == "__main__":
    for p in generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR):
        print(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
