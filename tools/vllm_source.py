"""The Python source of released vLLM wheels, for the version-keyed patch contract (tests/test_vllm_patch_contract.py).

``python tools/vllm_source.py [VERSION ...]`` (default: ``qwen4exp.vllm.patches.CONTRACT_WHEELS``' versions) runs
``pip download vllm==VERSION --no-deps`` into a scratch folder, unpacks only the ``vllm/**.py`` files into
``.cache/vllm-src/VERSION/`` (a few tens of MB of the wheel's ~340 MB; no compiled extension, nothing imported) and
deletes the wheel. A version already unpacked (its ``.complete`` marker present) is left alone, so CI downloads each
wheel once per cache. Exits non-zero, naming the version and pip's last lines, when a download fails; the contract
test then fails saying which source is missing and this command.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC_DIR = os.path.join(ROOT, ".cache", "vllm-src")
MARKER = ".complete"


def source_dir(version: str) -> str:
    return os.path.join(SRC_DIR, version)


def have(version: str) -> bool:
    return os.path.exists(os.path.join(source_dir(version), MARKER))


def fetch(version: str) -> str:
    """Unpack vLLM ``version``'s Python files into ``source_dir(version)`` (once); returns that folder."""
    dest = source_dir(version)
    if have(version):
        return dest
    os.makedirs(SRC_DIR, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=SRC_DIR, prefix=f".download-{version}-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "-d", tmp, f"vllm=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if proc.returncode or len(wheels) != 1:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
            raise SystemExit(f"vllm_source: `pip download --no-deps vllm=={version}` failed (exit {proc.returncode}, "
                             f"wheels {wheels}):\n{tail}")
        part = os.path.join(tmp, "src")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z:
            names = [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            for n in names:
                z.extract(n, part)
            meta = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
            if meta:
                z.extract(meta[0], part)
        with open(os.path.join(part, MARKER), "w") as f:
            f.write(f"{wheels[0]}\n{len(names)} .py files\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(part, dest)
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("versions", nargs="*", help="vLLM versions (default: the contract's wheels)")
    args = ap.parse_args(argv)
    versions = args.versions
    if not versions:
        sys.path.insert(0, ROOT)
        from qwen4exp.vllm.patches import CONTRACT_WHEELS

        versions = list(CONTRACT_WHEELS.values())
    failed = []
    for v in versions:
        try:
            d = fetch(v)
        except SystemExit as e:
            print(e, file=sys.stderr)
            failed.append(v)
            continue
        print(f"vllm_source: vLLM {v} source in {os.path.relpath(d, ROOT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
