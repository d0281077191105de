"""The README and the guides say what runs: every `memtrain plan` command in a code block of README.md and
docs/guides/*.md runs offline and prints a plan, and every relative link in them (and in docs/STATUS.md)
names a file that exists and, with a `#fragment`, a heading in it (BENCHMARKS.md's summary too).

The plans run as a fresh machine without a network would run them (HF_HUB_OFFLINE, a throw-away Hugging
Face cache holding the fine-tuning recipes' config.json alone: tests/hf_cache.py). The QLoRA sample's
printed lines are compared with the command's output in tests/pretrained/test_real_scale_recipe.py.
The hole: the README's commands were checked one by one, by hand or not at all, as the README moved."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from memtrain.cli import main
from memtrain.planner import model_probe

import hf_cache
from helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs/guides").glob("*.md"))]
LINKED = [*DOCS, REPO / "docs/STATUS.md", REPO / "docs/BENCHMARKS.md"]


def shell_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks of a markdown text, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


def plan_commands() -> list[str]:
    """Each `memtrain plan` command of the README and the guides, once."""
    commands = [c for doc in DOCS for c in shell_commands(doc.read_text(encoding="utf-8"))]
    return list(dict.fromkeys(c for c in commands if c.startswith("memtrain plan ")))


def command_id(command: str) -> str:
    """A test id without spaces (tests/slow.txt lists node ids one a line)."""
    return re.sub(r"[^\w.=-]+", "_", command.removeprefix("memtrain plan ").replace("recipes/", ""))


def test_the_readme_holds_the_tour() -> None:
    """The two commands on the first screen, and a plan, a training run, a fine-tune and a mesh in the tour."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    first_screen = "\n".join(readme.splitlines()[:40])
    assert "bash scripts/train.sh" in first_screen and "bash scripts/test.sh" in first_screen
    commands = shell_commands(readme)
    assert any(c.startswith("memtrain plan recipes/llama3-8b-qlora-24gb.yaml") for c in commands)
    assert "memtrain train recipes/default.yaml" in commands
    assert any(c.startswith("torchrun") and "llama3-8b-chat-sft" in c for c in commands)
    assert any(c.startswith("memtrain plan") and "--nodes" in c for c in commands)
    assert len(readme.splitlines()) <= 250


@pytest.mark.slow
@pytest.mark.parametrize("command", plan_commands(), ids=command_id)
def test_every_plan_command_prints_a_plan(
    command: str, staged_cache: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(shlex.split(command)[1:])
    seconds = time.perf_counter() - start
    print(f"{seconds:.1f} s: {command}")
    assert rc == 0 and "Traceback" not in err.getvalue(), err.getvalue()[-3000:]
    printed = out.getvalue()
    assert printed.startswith("{") or "chosen" in printed, printed[-3000:]


@pytest.fixture(scope="module")
def staged_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The fine-tuning recipes' hub id with its config.json alone, offline; one plan's traces shared with
    the next plan of the same job."""
    with pytest.MonkeyPatch.context() as patch, model_probe.shared_traces():
        hf_cache.stage(tmp_path_factory.mktemp("readme"), patch, config_only=True)
        yield None


@pytest.mark.parametrize("doc", LINKED, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, fragment = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            broken.append(target)
        elif fragment and fragment not in anchors(linked):
            broken.append(target)
    assert not broken, f"{doc.relative_to(REPO)}: links to nothing: {broken}"


def anchors(markdown: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation but '-' dropped, spaces '-'."""
    headings = re.findall(r"^#+ (.+)$", markdown.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
