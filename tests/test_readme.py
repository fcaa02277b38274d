"""The README's quick-start example runs as written, and its "The API" section names the contract."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_public_api import CLIENT_METHODS, CONTRACT

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_readme_quick_start_runs():
    block = re.search(r"```python\n(import torch\nimport transfer_queue.*?)```", README, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})


def test_the_api_section_names_every_contract_name_and_client_method():
    section = re.search(r"^## The API\n(.*?)^## ", README, re.S | re.M).group(1)
    named = set(re.findall(r"\b\w+\b", section))
    missing = sorted((CONTRACT | CLIENT_METHODS) - named)
    assert not missing, f"README's 'The API' section does not name: {missing}"
