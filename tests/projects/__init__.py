"""LightningModules ported from public Lightning 1.x projects, trained by ``tests/test_projects.py``.

Each file starts with where its code comes from (repository, file, commit, licence) and what was changed to make it
small. The ported code is kept as its authors wrote it, so ruff is told to leave each of those files alone.
"""
