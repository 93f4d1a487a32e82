"""The committed gRPC stubs match what protos/build.py generates from the .proto (not stale); buf
(a tool nobody here wrote) lints the API and finds no breaking change against v1 as published."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from protos import build


def test_committed_stubs_are_up_to_date(tmp_path: Path) -> None:
    generated = build.build(tmp_path)
    assert generated, "protos/build.py generated nothing"
    stale = []
    for path in generated:
        rel = path.relative_to(tmp_path)
        committed = build.REPO_ROOT / rel
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            stale.append(str(rel))
    assert not stale, f"stale generated stubs {stale}: run `python -m protos.build` and commit them"


def test_generated_imports_are_package_qualified() -> None:
    from protos.specdecode.v1 import specdecode_pb2, specdecode_pb2_grpc

    assert specdecode_pb2.DESCRIPTOR.package == "specdecode.v1"
    service = specdecode_pb2.DESCRIPTOR.services_by_name["SpecDecode"]
    assert {m.name for m in service.methods} == {"Generate", "GetModelInfo"}
    assert service.methods_by_name["Generate"].server_streaming
    assert callable(specdecode_pb2_grpc.add_SpecDecodeServicer_to_server)
    source = Path(specdecode_pb2_grpc.__file__).read_text()
    assert "from protos.specdecode.v1 import specdecode_pb2" in source


def test_request_fields_follow_sampling_params() -> None:
    from protos.specdecode.v1 import specdecode_pb2 as pb

    fields = set(pb.GenerateRequest.DESCRIPTOR.fields_by_name)
    assert {"prompt", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
            "speculation", "max_speculative_tokens", "request_id"} <= fields
    oneof = pb.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"]
    assert {f.name for f in oneof.fields} == {"prompt", "prompt_token_ids", "chat"}
    assert pb.GenerateRequest(seed=0).HasField("seed")  # seed 0 is distinct from no seed


PUBLISHED = build.REPO_ROOT / "protos" / "published" / "specdecode_v1.binpb"


def _buf(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "buf"  # buf-bin (the dev extra)
    assert exe.exists(), f"{exe} missing: `make install` installs buf-bin"
    return subprocess.run([str(exe), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_buf_lint_and_no_breaking_change_against_the_published_v1(tmp_path: Path) -> None:
    protos = build.REPO_ROOT / "protos"
    lint = _buf("lint", cwd=protos)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    breaking = _buf("breaking", "--against", str(PUBLISHED), cwd=protos)
    assert breaking.returncode == 0, breaking.stdout + breaking.stderr
    # the check can fail: the same module with a field renumbered and a method removed
    shutil.copy(protos / "buf.yaml", tmp_path / "buf.yaml")
    (tmp_path / "specdecode" / "v1").mkdir(parents=True)
    source = (protos / "specdecode" / "v1" / "specdecode.proto").read_text()
    changed = source.replace("optional int32 max_tokens = 3;", "optional int32 max_tokens = 30;")
    changed = changed.replace("  rpc GetModelInfo(GetModelInfoRequest) returns (ModelInfo);\n", "")
    assert changed.count("\n") == source.count("\n") - 1, "the proto changed under the test: update it"
    (tmp_path / "specdecode" / "v1" / "specdecode.proto").write_text(changed)
    broken = _buf("breaking", "--against", str(PUBLISHED), cwd=tmp_path)
    assert broken.returncode != 0
    assert "max_tokens" in broken.stdout and "GetModelInfo" in broken.stdout, broken.stdout + broken.stderr
