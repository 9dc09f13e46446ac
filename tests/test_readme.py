"""The README's HF snippet runs as written (so it cannot rot), it names no removed switch, and the docs' links resolve
(the README's other commands: tests/test_readme_commands.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_hf_snippet_runs_and_generates_text(tmp_path):
    """The README's first python block, the HF snippet (its other blocks, OpenAI clients:
    tests/test_readme_commands.py)."""
    blocks = python_blocks(README.read_text())
    assert blocks and "from transformers import AutoTokenizer" in blocks[0], \
        "README.md's first python block should be the HF snippet"
    script = tmp_path / "readme_snippet.py"
    script.write_text(blocks[0])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout.strip()
    assert len(text) >= 20 and re.search(r"[A-Za-z]{2,}", text), f"no generated text: {proc.stdout!r}"


def test_readme_names_no_removed_switch():
    text = README.read_text()
    for gone in ("QWEN4EXP_KNOBS", "QWEN4EXP_PLE_PADS", "QWEN4EXP_QSA_METADATA", "QWEN4EXP_HOST_SAMPLE",
                 "pick_knobs", "tune-decode", "notes/"):
        assert gone not in text, gone


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # (a '# comment' in a code block is no heading)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_doc_links_resolve():
    """Every relative link of the docs names a file that exists, and a #fragment a heading of that file."""
    for doc in (README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "qwen4exp" / "vllm" / "README.md"):
        for link in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if "://" in link:
                continue
            path, _, frag = link.partition("#")
            target = doc.parent / path if path else doc
            assert target.exists(), f"{doc.relative_to(ROOT)}: {link}"
            if frag and target.suffix == ".md":
                assert frag in anchors(target.read_text()), f"{doc.relative_to(ROOT)}: {link} (no such heading)"
