"""The README's runnable snippets (```python blocks) run as written, each as ``python snippet.py``
in a process of its own; ```py blocks illustrate."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import preloaded

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_runnable_snippets():
    assert len(BLOCKS) >= 1


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs(index, tmp_path):
    script = tmp_path / f"snippet_{index}.py"
    script.write_text(BLOCKS[index])
    proc = preloaded.run_script(str(script), cwd=str(tmp_path), timeout=240)
    assert proc.returncode == 0, f"README snippet {index} failed:\n{BLOCKS[index]}\n{proc.stderr}"
