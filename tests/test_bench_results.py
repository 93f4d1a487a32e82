"""Result files: the stamp `bench.common.write_results` puts in every bench's JSON, the host
classes results are filed under, and the generated bench/results/README.md, which must be what
`python -m bench.results_index` makes of the checked-in results (so it cannot go stale)."""

import json

import pytest

from bench import common, results_index

STAMP_FIELDS = {"commit", "dirty", "date", "host", "cpu", "cpu_flags", "cores", "gpu", "torch", "command"}


def test_write_results_stamps_and_files_under_the_host_class(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    path = common.write_results("tiny", {"rows": [1, 2]})
    assert path == tmp_path / common.host_class() / "tiny.json"
    data = json.loads(path.read_text())
    assert data["rows"] == [1, 2]
    stamp = data["provenance"]
    assert STAMP_FIELDS <= set(stamp)
    assert stamp["host"] == common.host_class()
    assert stamp["date"].endswith("Z") and stamp["torch"] and stamp["command"].startswith("python")
    assert set(stamp["cpu_flags"]) <= set(common.CPU_FLAGS)


def test_out_overrides_the_path(tmp_path):
    out = tmp_path / "elsewhere" / "x.json"
    assert common.write_results("tiny", {}, out) == out
    assert "provenance" in json.loads(out.read_text())


@pytest.mark.parametrize(("cpu", "gpu", "host"), [
    ({"vendor": "GenuineIntel", "flags": ["avx2", "avx512f", "amx_tile"]}, None, "intel-amx"),
    ({"vendor": "GenuineIntel", "flags": ["avx2", "avx512f"]}, None, "intel-avx512"),
    ({"vendor": "AuthenticAMD", "family": 25, "flags": ["avx2", "avx512f", "avx512_bf16"]}, None, "amd-zen4"),
    ({"vendor": "AuthenticAMD", "family": 25, "flags": ["avx2", "fma"]}, None, "amd-zen3"),
    ({"vendor": "", "model_name": "Apple M2 Max", "flags": []}, None, "apple-m2-max"),
    ({"vendor": "AuthenticAMD", "family": 25, "flags": ["avx2"]}, "NVIDIA H200", "nvidia-h200"),
    ({}, "NVIDIA H100 80GB HBM3", "nvidia-h100"),
])
def test_host_class(cpu, gpu, host):
    assert common.host_class(cpu, gpu) == host


def test_cpu_info_reads_the_first_processor():
    text = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
            "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu avx2 fma avx512f amx_tile amx_bf16\n\n"
            "processor\t: 1\nvendor_id\t: OtherVendor\n")
    info = common.cpu_info(text)
    assert info["vendor"] == "GenuineIntel" and info["family"] == 6 and info["model"] == 143
    assert info["flags"] == ["avx2", "fma", "avx512f", "amx_tile", "amx_bf16"]
    assert common.host_class(info) == "intel-amx"


def test_every_checked_in_result_is_stamped_for_its_folder():
    paths = sorted(results_index.RESULTS.glob("*/*.json"))
    assert paths
    for path in paths:
        stamp = json.loads(path.read_text())["provenance"]
        assert STAMP_FIELDS <= set(stamp), path
        assert stamp["host"] == path.parent.name, path


def test_results_readme_is_generated_from_the_results():
    readme = results_index.RESULTS / "README.md"
    assert readme.read_text() == results_index.render(), (
        "bench/results/README.md is stale: run `python -m bench.results_index`")


def test_index_lists_each_result_once(tmp_path):
    (tmp_path / "amd-zen4").mkdir()
    stamp = {"commit": "0123456789abcdef", "dirty": False, "date": "2026-01-02T03:04:05Z", "host": "amd-zen4",
             "cpu": "AMD EPYC", "cpu_flags": ["avx2"], "cores": 2, "gpu": None, "torch": "2", "command": "python -m x | y"}
    (tmp_path / "amd-zen4" / "spec.json").write_text(json.dumps({"provenance": stamp}))
    text = results_index.render(tmp_path)
    assert "## amd-zen4" in text
    assert "| spec | 2026-01-02 | 0123456 | `python -m x \\| y` | [amd-zen4/spec.json](amd-zen4/spec.json) |" in text
    (tmp_path / "amd-zen4" / "spec.json").write_text(json.dumps({"provenance": {**stamp, "host": "intel-amx"}}))
    with pytest.raises(ValueError, match="filed under"):
        results_index.render(tmp_path)
