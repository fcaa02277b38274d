"""The README's quick-start example runs as written."""

from __future__ import annotations

import re
from pathlib import Path


def test_readme_quick_start_runs():
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = re.search(r"```python\n(import torch\nimport transfer_queue.*?)```", text, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})
