"""The documentation says what the code is: every code block runs, every link resolves, the tables match the code.

Every fenced block of ``README.md`` and ``docs/*.md`` is one of:

- a ``python`` block: run as a script of its own, in the repository root, its Trainer writing under a tmp folder;
- a ``bash`` block: each command run in the repository root (its run folder moved under a tmp folder), exiting 0;
- a ``yaml`` block: parsed by ``lightning-mgpu fit --print_config`` (on top of ``configs/quickstart.yaml`` when it
  holds no model), which must keep every value the block sets;
- a block after ``<!-- output of the command above -->`` (``; it exits with N`` when it fails on purpose): its text,
  whitespace aside and ``…`` standing for anything, must appear in the output of each command of the bash block
  before it;
- a block after ``<!-- run by tests/FILE.py::TEST -->`` or ``<!-- checked by ... -->``: that test reads it;
- a block after ``<!-- not run: REASON -->``: why it cannot run on a CPU machine in the tests.

Anything else fails ``test_every_code_block_runs_or_says_why_not``. The blocks that start processes run in the
``slow`` test ``test_the_block_runs``, a few at a time, started in order as earlier ones end.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from processes import SELECTED_BLOCKS, clean_env, free_port, start_in_session, stop_session

import lightning_mgpu
from lightning_mgpu.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
README_LINES = 300
JOB_TIMEOUT = 240
PARALLEL_JOBS = 3
"""Commands run at once: each starts one to three processes, and the tests run on 2 CPU cores."""

NOT_RUN = re.compile(r"<!-- not run: (\S.*\S) -->")
OUTPUT = re.compile(r"<!-- output of the command above(?:; it exits with (\d+))? -->")
CHECKED_BY = re.compile(r"<!-- (?:run|checked) by (tests/\w+\.py)::(\w+) -->")
FENCE = re.compile(r"^( *)```(\w*)$")


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its text and the HTML comment on the line before it."""

    document: str
    line: int
    language: str
    text: str
    marker: str

    @property
    def name(self) -> str:
        return f"{self.document}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, language = opening.groups()
        end = next(i for i in range(index + 1, len(lines)) if lines[i] == f"{indent}```")
        text = "".join(line.removeprefix(indent) + "\n" for line in lines[index + 1 : end])
        before = lines[index - 1].strip() if index else ""
        marker = before if before.startswith("<!--") else ""
        blocks.append(Block(path.relative_to(ROOT).as_posix(), index + 1, language, text, marker))
        index = end + 1
    return blocks


BLOCKS = [block for path in DOCUMENTS for block in _blocks(path)]


def _output_of(block: Block) -> Block | None:
    """The block after ``block`` in its document when it is marked as ``block``'s output."""
    following = [other for other in BLOCKS if other.document == block.document and other.line > block.line]
    return following[0] if following and OUTPUT.fullmatch(following[0].marker) else None


def _how_checked(block: Block) -> str | None:
    """How the tests check ``block``, or None when nothing does."""
    if NOT_RUN.fullmatch(block.marker) or CHECKED_BY.fullmatch(block.marker):
        return block.marker
    if OUTPUT.fullmatch(block.marker):
        earlier = [other for other in BLOCKS if other.document == block.document and other.line < block.line]
        ran = earlier and earlier[-1].language == "bash" and not earlier[-1].marker
        return "the output of the bash block before it" if ran else None
    if block.marker:
        return None  # a comment that is none of the markers: a misspelt marker must not pass for one
    return {"python": "run", "bash": "run", "yaml": "parsed by the CLI"}.get(block.language)


RUN = [pytest.param(block, id=block.name) for block in BLOCKS if _how_checked(block) == "run"]
YAML = [pytest.param(block, id=block.name) for block in BLOCKS if _how_checked(block) == "parsed by the CLI"]


def test_every_code_block_runs_or_says_why_not() -> None:
    unchecked = [f"{block.name} ({block.language or 'no language'})" for block in BLOCKS if not _how_checked(block)]
    assert not unchecked, (
        f"code blocks that no test runs: {unchecked}. Make them run (python, bash, yaml), or put"
        " '<!-- not run: why it cannot run on a CPU machine -->' on the line before the block"
    )


def test_the_tests_named_by_blocks_exist_and_read_the_document() -> None:
    for block in BLOCKS:
        named = CHECKED_BY.fullmatch(block.marker)
        if named:
            source = (ROOT / named.group(1)).read_text()
            assert f"def {named.group(2)}(" in source, f"{block.name}: {named.group(1)} has no {named.group(2)}"
            assert Path(block.document).name in source, f"{block.name}: {named.group(1)} never reads {block.document}"


def test_the_readme_is_a_ten_minute_read_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= README_LINES, f"README.md has {len(readme)} lines; move details into docs/"
    quick_start = 'python -m pip install torch==2.13.0 && python -m pip install -e ".[examples]" && lightning-mgpu fit'
    assert f"{quick_start} --config configs/quickstart.yaml" in readme
    assert any(line.endswith("&& python -m pytest -q") for line in readme)


# Links


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    anchors: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE):
        slug, count = _slug(heading), 1
        while slug in anchors:  # GitHub numbers repeated headings
            slug, count = f"{_slug(heading)}-{count}", count + 1
        anchors.add(slug)
    return anchors


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_relative_link_points_to_a_file_and_heading_that_exist(document: Path) -> None:
    text = re.sub(r"^```.*?^```$", "", document.read_text(), flags=re.MULTILINE | re.DOTALL)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue  # https:, mailto:
        target, _, anchor = link.partition("#")
        path = (document.parent / target).resolve() if target else document
        if not path.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link} (no such heading in {path.name})")
    assert not broken, f"{document.name}: {broken}"


# The tables


def _effective_settings(name: str) -> tuple[type, dict[str, Any]]:
    entry = StrategyRegistry[name]
    defaults = {"start_method": "popen", "find_unused_parameters": False}
    return entry["strategy"], defaults | entry["init_params"]


def test_the_ddp_names_table_matches_both_registries() -> None:
    text = (ROOT / "docs" / "ddp.md").read_text()
    section = text.split("## Lightning's DDP names", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \| (.+) \|$", section, flags=re.MULTILINE)
    lightning_names = {
        name for name in StrategyRegistry.available_strategies() if StrategyRegistry[name]["strategy"] is DDPStrategy
    }
    assert {lightning for lightning, _, _ in rows} == lightning_names
    for lightning, ours, settings in rows:
        assert ours == f"mgpu_{lightning}"
        lightning_class, lightning_settings = _effective_settings(lightning)
        our_class, our_settings = _effective_settings(ours)
        assert our_class is lightning_mgpu.MGPUDDPStrategy
        assert our_settings == lightning_settings, ours
        stated = dict(re.findall(r"`(\w+)=([^`]+)`", settings))
        assert {key: str(our_settings[key]) for key in stated} == {k: v.strip('"') for k, v in stated.items()}, ours


# YAML blocks


def _assert_kept(written: Any, printed: Any, path: str) -> None:
    """Every value ``written`` sets is in ``printed`` at the same key path."""
    if isinstance(written, dict):
        assert isinstance(printed, dict), f"{path}: {printed!r}"
        for key, value in written.items():
            assert key in printed, f"{path}.{key} is not in the parsed config"
            _assert_kept(value, printed[key], f"{path}.{key}")
    else:
        assert printed == written, f"{path}: {printed!r} != {written!r}"


@pytest.mark.parametrize("block", YAML)
def test_the_yaml_block_parses_with_the_cli(
    block: Block, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])
    monkeypatch.syspath_prepend(str(ROOT))  # examples.density, as the CLI resolves it from the repository root
    written = yaml.safe_load(block.text)
    config = tmp_path / "block.yaml"
    config.write_text(block.text)
    base = [] if "model" in written else ["--config", str(QUICKSTART)]  # a fragment: on top of a complete config
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *base, "--config", str(config), "--print_config"])
    assert exit_.value.code in (0, None)
    _assert_kept(written, yaml.safe_load(capsys.readouterr().out), "config")


# Python and bash blocks, run as processes


def _commands(block: Block) -> list[list[str]]:
    """The block's commands, split at ``&&``, comments and ``pip install`` left out.

    The test environment has the packages installed already, and no network to install from.
    """
    commands: list[list[str]] = []
    for line in block.text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        start = 0
        for end in [*(i for i, word in enumerate(words) if word == "&&"), len(words)]:
            command, start = words[start:end], end + 1
            if command and command[:4] != ["python", "-m", "pip", "install"]:
                commands.append(command)
    return commands


def _as_run_here(command: list[str], out: Path) -> list[str]:
    """``command`` on this interpreter, with its run folder under ``out``."""
    program, *args = command
    prefix = {
        "python": [sys.executable],
        "lightning-mgpu": [sys.executable, "-m", "lightning_mgpu"],  # the same command as the console script
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    }.get(program)
    assert prefix, f"the tests do not know how to run {program!r}: mark the block '<!-- not run: why -->'"
    if "lightning_mgpu" in args:  # python -m [launcher ... -m] lightning_mgpu
        args_of_the_cli = args[args.index("lightning_mgpu") + 1 :]
    else:
        args_of_the_cli = args if program == "lightning-mgpu" else []
    if args_of_the_cli[:1] in (["fit"], ["validate"], ["test"], ["predict"]):
        args = [*args, "--trainer.default_root_dir", str(out)]
    elif "examples/train.py" in args:
        args = [*args, "--out", str(out)]
    return prefix + args


@dataclass
class Job:
    """One command, started when a slot is free, its output going to ``log``."""

    command: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    started: float = field(default=0.0)

    def start(self) -> None:
        port = str(free_port())
        env = {**self.env, "MASTER_PORT": port, "PET_MASTER_PORT": port}  # PET_: torchrun's --master-port
        self.process = start_in_session(self.command, ROOT, env, self.log)
        self.started = time.monotonic()

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is not None:
            stop_session(self.process)


class Jobs:
    """The commands of the selected blocks, in block order, ``PARALLEL_JOBS`` at a time."""

    def __init__(self, jobs: dict[Block, list[Job]]) -> None:
        self.jobs = jobs
        self.queue = [job for block_jobs in jobs.values() for job in block_jobs]

    def _start_more(self) -> None:
        waiting = [job for job in self.queue if job.process is None]
        free = PARALLEL_JOBS - sum(job.running() for job in self.queue)
        for job in waiting[: max(free, 0)]:
            job.start()

    def results(self, block: Block) -> list[tuple[list[str], int, str]]:
        """Each command of ``block`` with its exit code and output, once all have ended."""
        results = []
        for job in self.jobs[block]:
            while job.process is None or job.running():
                self._start_more()
                if job.process is not None and time.monotonic() - job.started > JOB_TIMEOUT:
                    job.stop()
                    pytest.fail(f"{block.name}: {job.command} timed out after {JOB_TIMEOUT} s")
                time.sleep(0.2)
            assert job.process is not None
            results.append((job.command, job.process.returncode, job.log.read_text(errors="replace")))
        return results

    def close(self) -> None:
        for job in self.queue:
            job.stop()


@pytest.fixture(scope="module")
def jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jobs]:
    """A job per command of every block the selected tests run (recorded by ``tests/conftest.py``); none starts before
    a test waits for one."""
    selected = [block for block in request.config.stash.get(SELECTED_BLOCKS, []) if _how_checked(block) == "run"]
    queued: dict[Block, list[Job]] = {}
    for block in selected:
        folder = tmp_path_factory.mktemp("block")
        out = folder / "runs"
        if block.language == "python":
            script = folder / "block.py"
            script.write_text(block.text)
            commands = [[sys.executable, str(script)]]
        else:
            commands = [_as_run_here(command, out / str(i)) for i, command in enumerate(_commands(block))]
        env = clean_env(PL_TRAINER_DEFAULT_ROOT_DIR=str(out))  # the default root of every Trainer the block builds
        queued[block] = [Job(command, env, folder / f"output{i}.log") for i, command in enumerate(commands)]
    running = Jobs(queued)
    yield running
    running.close()


def _readable(output: str, limit: int = 3000) -> str:
    lines = [line for line in output.replace("\r", "\n").splitlines() if line.strip() and "it/s]" not in line]
    return "\n".join(lines)[-limit:]


def _shown_in(shown: str, output: str) -> bool:
    """Whether ``output`` holds ``shown``, whitespace aside, ``…`` in ``shown`` standing for anything."""
    pattern = ".*?".join(re.escape(" ".join(part.split())) for part in shown.split("…"))
    return re.search(pattern, " ".join(output.split()), flags=re.DOTALL) is not None


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN)
def test_the_block_runs(block: Block, jobs: Jobs) -> None:
    shown = _output_of(block)
    exits_with = OUTPUT.fullmatch(shown.marker) if shown else None
    expected = int(exits_with.group(1) or 0) if exits_with else 0
    results = jobs.results(block)
    assert results, f"{block.name} holds no command to run"
    for command, code, output in results:
        assert code == expected, f"{shlex.join(command)} exited with {code}:\n{_readable(output)}"
        if shown:
            assert _shown_in(shown.text, output), (
                f"{shown.name} is not what {shlex.join(command)} printed:\n{_readable(output)}"
            )


# docs/architecture.md


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
