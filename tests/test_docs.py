"""The documentation stays true to the code: the configuration reference is current, every local link resolves,
and the README's two commands are the ones CI runs. Pure Python on text files: no torch, no megatron-core."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
INSTALL_AND_EXAMPLE = "bash tools/install.sh && .venv/bin/gspo-megatron train examples/tiny_moe_cpu.yaml"
INSTALL_AND_TESTS = "bash tools/install.sh && .venv/bin/python -m pytest"


def _config_reference():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "tools" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_current():
    reference = _config_reference()
    assert (DOCS / "configuration.md").read_text() == reference.render(), (
        f"docs/configuration.md is stale (gspo_megatron/train/config.py changed): run {reference.COMMAND}")


def test_configuration_reference_has_every_field_of_every_section():
    """Each dataclass field appears as `section.field`, the docstring beside it (a field read from the source)."""
    reference = _config_reference()
    source = """
from dataclasses import dataclass, field
@dataclass
class AConfig:
    \"\"\"The a section.\"\"\"
    x: int = 3
    \"\"\"Three, or | more.\"\"\"
    names: list = field(default_factory=lambda: ["q"])
    flag: bool | None = None
@dataclass
class Config:
    a: AConfig = field(default_factory=AConfig)
"""
    text = reference.render(source)
    assert "## a\n\nThe a section.\n" in text
    assert "| `a.x` | `int` | `3` | Three, or \\| more. |" in text
    assert "| `a.names` | `list` | `['q']` |  |" in text
    assert "| `a.flag` | `bool \\| None` | `null` |  |" in text


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens."""
    heading = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file (a repeated one gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Links of a Markdown file to local files, or their headings, that do not resolve; web links are not fetched."""
    broken = []
    for target in _LINK.findall(_prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:: not ours to check
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{path.relative_to(root)}: {target} (no file {file})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{path.relative_to(root)}: {target} (no heading #{anchor} in {file or path.name})")
    return broken


def test_slugs_are_githubs():
    assert slug("Throughput: packed sequences, token-budget micro batches") == (
        "throughput-packed-sequences-token-budget-micro-batches")
    assert slug("Megatron-Core 0.16.1 and 0.19.2 on CPU") == "megatron-core-0161-and-0192-on-cpu"
    assert slug("The `performance` section") == "the-performance-section"
    assert slug("GPU paths (NCCL, TE), multi-node") == "gpu-paths-nccl-te-multi-node"


def test_the_link_checker_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page.write_text("# Page\n\n[ok](other.md#a-section) [self](#page) [gone](missing.md) [no](other.md#nope)\n"
                    "`[code](missing2.md)`\n```\n[fenced](missing3.md)\n```\n[web](https://example.com/x)\n")
    assert broken_links(page, tmp_path) == ["page.md: missing.md (no file missing.md)",
                                            "page.md: other.md#nope (no heading #nope in other.md)"]


def test_links_in_the_readme_and_docs_resolve():
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    broken = [problem for page in pages for problem in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_in_the_index():
    index = (DOCS / "README.md").read_text()
    missing = [page.name for page in sorted(DOCS.glob("*.md"))
               if page.name != "README.md" and f"({page.name}" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


def test_the_readme_is_a_guide():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "README.md over 250 lines: move the detail to a docs/ page"
    assert INSTALL_AND_EXAMPLE in readme.splitlines() and INSTALL_AND_TESTS in readme.splitlines()


def test_ci_runs_exactly_the_readmes_test_command():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert lines[-1] == INSTALL_AND_TESTS
