"""The documentation says what the code is: docs/architecture.md lists exactly the package's files."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _files_in_the_tree(text: str) -> set[str]:
    """The paths the ``text`` block's tree names, folders joined by their indentation."""
    tree = text.split("```text\n", 1)[1].split("```", 1)[0]
    names: set[str] = set()
    folders: list[str] = []
    for line in tree.splitlines()[1:]:
        entry = re.match(r"^((?:│   |    )*)(?:├── |└── )(\S+)", line)
        assert entry, f"not a tree line: {line!r}"
        depth = len(entry.group(1)) // 4
        name = entry.group(2)
        del folders[depth:]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        else:
            names.add("/".join([*folders, name]))
    return names


def test_the_architecture_lists_every_file_of_the_package_and_no_other() -> None:
    listed = _files_in_the_tree((ROOT / "docs" / "architecture.md").read_text())
    package = ROOT / "lightning_mgpu"
    present = {path.relative_to(package).as_posix() for path in package.rglob("*.py")}
    assert listed == present, f"missing: {sorted(present - listed)}, gone: {sorted(listed - present)}"


def test_the_architecture_names_only_files_and_methods_that_exist() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    for path in set(re.findall(r"`((?:engine|step|strategies|doctor|cli)/\w+\.py)`", text)):
        assert (ROOT / "lightning_mgpu" / path).is_file(), path
    from lightning_mgpu import MGPUDataParallel

    for method in ("scatter", "scatter_batch", "replicate", "parallel_apply", "gather", "forward"):
        assert f"`{method}" in text or f".{method}(" in text, method
        assert callable(getattr(MGPUDataParallel, method)), method
