"""The README starts where a user starts (the two commands on its first screen, a tour, at most 250 lines),
and every relative link in it, the guides, docs/STATUS.md and BENCHMARKS.md's summary names a file that
exists and, with a `#fragment`, a heading in it. Every `memtrain plan` command of the guides that the README
does not hold runs here, offline, as a fresh machine without a network runs it (HF_HUB_OFFLINE, a
throw-away Hugging Face cache holding the fine-tuning recipes' config.json alone: tests/hf_cache.py); the
README's run in tests/pretrained/test_real_scale_recipe.py beside the recipes' own plans (their traces
shared), which also compares the QLoRA sample with what its command prints.
The hole: the README's commands were checked one by one, by hand or not at all, as the README moved."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from memtrain.cli import main
from memtrain.planner import model_probe

import hf_cache
from helpers import GUIDES, REPO, command_id, plan_commands, shell_commands

LINKED = [
    REPO / "README.md",
    *sorted((REPO / "docs/guides").glob("*.md")),
    REPO / "docs/STATUS.md",
    REPO / "docs/BENCHMARKS.md",
]


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


@pytest.fixture(scope="module")
def offline_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The fine-tuning recipes' hub id with its config.json alone, offline; one plan's traces shared with
    the next plan of the same job."""
    with pytest.MonkeyPatch.context() as patch, model_probe.shared_traces():
        hf_cache.stage(tmp_path_factory.mktemp("guides"), patch, config_only=True)
        yield


@pytest.mark.parametrize("command", plan_commands(GUIDES, besides=(REPO / "README.md",)), ids=command_id)
def test_every_plan_command_of_the_guides_prints_a_plan(
    offline_cache: None, command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(shlex.split(command)[1:])
    assert rc == 0 and "Traceback" not in err.getvalue(), err.getvalue()[-3000:]
    assert out.getvalue().startswith("{") or "chosen" in out.getvalue(), out.getvalue()[-3000:]


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
