"""The committed gRPC stubs match what protos/build.py generates from the .proto (not stale)."""

from __future__ import annotations

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
    assert {f.name for f in oneof.fields} == {"prompt", "prompt_token_ids"}
    assert pb.GenerateRequest(seed=0).HasField("seed")  # seed 0 is distinct from no seed
