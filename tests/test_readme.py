"""The README's runnable snippets (```python blocks) run as written; ```py blocks illustrate."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_runnable_snippets():
    assert len(BLOCKS) >= 1


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs(index, tmp_path):
    script = tmp_path / f"snippet_{index}.py"
    script.write_text(BLOCKS[index])
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"README snippet {index} failed:\n{BLOCKS[index]}\n{proc.stderr}"
