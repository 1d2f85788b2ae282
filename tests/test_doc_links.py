"""The documentation points at things that exist: every relative link of README.md, CONTRIBUTING.md, docs/*.md and
benchmarks/README.md reaches a file (and its anchor a heading of that file), every repository path they name in
backticks exists (or is an output location git ignores), and none names a module by its path from before the
package was split into role folders."""

import re
import subprocess
from pathlib import Path

import pytest

from lit_grpo._layout import MOVED

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")),
         ROOT / "benchmarks" / "README.md"]
#: the repository's top-level folders a path in the docs starts with
FOLDERS = ("lit_grpo/", "callbacks/", "configs/", "tests/", "benchmarks/", "experiments/", "docs/", "examples/")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\s]+)`")


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (a ``#`` there is a comment, not a heading; a link there is code)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings: lower case, punctuation but ``-`` and ``_`` dropped, spaces
    to ``-``; a repeated heading gets ``-1``, ``-2``, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", prose(page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def ignored(path: str) -> bool:
    """Whether git ignores ``path`` (an output location, such as ``benchmarks/results/``)."""
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0


def named_paths(text: str) -> set[str]:
    """The repository paths ``text`` names in backticks, cut at the first character no path has (``:`` of
    ``module:function``, a space, ...): a span that starts with a top-level folder, or a relative file path such as
    ``engines/remote/client.py`` (read from the top of the repository or of ``lit_grpo/``)."""
    paths = set()
    for span in CODE_SPAN.findall(text):
        path = re.match(r"[\w./*\-<>\[\]]*", span).group(0).rstrip(".")
        if path.startswith(FOLDERS) or ("/" in path and re.search(r"\.(py|md|yaml|json|png)$", path)):
            paths.add(path)
    # and a file under a top-level folder anywhere in the prose, backticks or not
    paths.update(re.findall(rf"(?<![\w/.])(?:{'|'.join(FOLDERS)})[\w/\-]*\.(?:py|md|yaml)\b", text))
    return paths


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` that reach no file, or no heading of it."""
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no heading with anchor #{anchor} in {file.name})")
    return broken


def missing_paths(text: str) -> list[str]:
    """The paths ``text`` names that exist neither in the repository (nor under ``lit_grpo/``) nor as an output
    location git ignores; a pattern with ``<...>`` or ``[...]`` is a template, not a path."""
    missing = []
    for path in sorted(named_paths(text)):
        if "<" in path or "[" in path:
            continue
        bases = [ROOT] if path.startswith(FOLDERS) else [ROOT, ROOT / "lit_grpo"]
        if not any(list(base.glob(path)) if "*" in path else (base / path).exists() for base in bases) \
                and not ignored(path):
            missing.append(path)
    return missing


def stale_names(text: str) -> list[str]:
    """The modules ``text`` names by their path or import path from before the split into role folders."""
    stale = []
    for old, new in MOVED.items():
        file = old.replace(".", "/") + ".py"
        if re.search(rf"(?<![\w/]){re.escape(file)}", text) or re.search(rf"(?<![\w.]){re.escape(old)}(?!\w)", text):
            stale.append(f"{old} (now {new})")
    return stale


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_heading(page):
    assert not broken_links(page), f"{page.relative_to(ROOT)}: broken links: {broken_links(page)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_repository_path_exists(page):
    missing = missing_paths(page.read_text())
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_named_by_its_path_before_the_split(page):
    stale = stale_names(page.read_text())
    assert not stale, f"{page.relative_to(ROOT)} names moved modules by their old path: {stale}"


def test_the_checks_catch_what_they_look_for(tmp_path):
    """Each check reports what it looks for (so the page tests cannot pass vacuously), and only that."""
    page = tmp_path / "page.md"
    page.write_text("# A title\n[gone](nothing.md) [here](#a-title) [off](#nowhere) [web](https://example.org)\n"
                    "```bash\n# a comment, not a heading\n```\n")
    assert broken_links(page) == ["nothing.md (no such file)", "#nowhere (no heading with anchor #nowhere in page.md)"]
    text = ("`lit_grpo/training/module.py`'s `configs/demo_cpu.yaml` `train/loss` `lit_grpo/module.py` "
            "`engines/remote/client.py` `math/nothing.py` `tests/test_lora*.py` `benchmarks/results/step_time.json` "
            "and in prose lit_grpo/cli.py, ../docs/lora.md")
    assert missing_paths(text) == ["lit_grpo/cli.py", "lit_grpo/module.py", "math/nothing.py"]
    assert stale_names("`lit_grpo.module.GRPOModule`, lit_grpo/losses.py") == [
        "lit_grpo.module (now lit_grpo.training.module)", "lit_grpo.losses (now lit_grpo.training.losses)"]
    assert stale_names("lit_grpo.training.module, lit_grpo/training/losses.py, lit_grpo.models.lora") == []


def layout_entries(text: str) -> list[tuple[str, str]]:
    """``(folder, file)`` for every ``.py`` or ``.yaml`` file docs/layout.md's tree names: a file is read in the
    folder of the entry it is listed under (``  cli/`` under ``lit_grpo/`` is ``lit_grpo/cli``), or from
    ``lit_grpo/`` when written with a folder (``models/loading.py``)."""
    tree = re.search(r"^```\n(lit_grpo/.*?)^```", text, flags=re.S | re.M).group(1)
    entries, stack = [], []
    for line in tree.splitlines():
        entry = re.match(r"( *)([\w.]+/)(?=\s|$)", line)
        if entry:
            depth = len(entry.group(1)) // 2
            stack = stack[:depth] + [entry.group(2).rstrip("/")]
        folder = "/".join(stack)
        for name in re.findall(r"(?<![\w/.])([\w/]+\.(?:py|yaml))\b", line):
            entries.append(("lit_grpo", name) if "/" in name else (folder, name))
    return entries


def test_the_layout_page_names_files_where_they_are():
    entries = layout_entries((ROOT / "docs" / "layout.md").read_text())
    assert ("lit_grpo/training", "module.py") in entries and ("lit_grpo/engines/remote", "client.py") in entries
    missing = [f"{folder}/{name}" for folder, name in entries if not (ROOT / folder / name).exists()]
    assert not missing, f"docs/layout.md names files that are not there: {missing}"
