"""The docs match the code: the README's configuration and "what runs where" tables are
generated from the settings and the ACL grants; the ADR index lists every ADR with its status."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tokenbus import acl_table
from tokenbus.config import _groups, markdown_table, with_table
from tokenbus.marked import MissingBlock, with_block

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DECISIONS = ROOT / "docs" / "decisions"
# `Status: accepted[, amended by N | , superseded in part by N]`, then an optional
# parenthesis or sentence.
STATUS = re.compile(r"^Status: ([a-z0-9, ]+?)(?= \(|\.|$)", re.MULTILINE)
# A repository path named in the README or docs/*.md (`services/edge/gateway.py`,
# `shared/health.with_health`); the ADRs are records of their time and are not checked.
DOC_PATH = re.compile(
    r"(?<![\w./-])((?:services|shared|tokenbus|tests|deploy|bench|docs)/[\w./-]*\w)"
)
NOT_OURS = {
    "docs/source/performance.md",  # vLLM's repository
    "tokenbus/direct",  # a ratio's label, not a path
}
INDEX_ROW = re.compile(r"^\| \[(\d{4})\]\(([^)]+)\) \| .+ \| ([a-z0-9, ]+) \|$", re.MULTILINE)


def test_readme_configuration_table_matches_the_settings() -> None:
    text = README.read_text()
    assert with_table(text) == text, (
        "README's configuration table is stale: run `tokenbus config --update README.md`"
    )


def test_readme_what_runs_where_table_matches_the_acls() -> None:
    text = README.read_text()
    assert acl_table.with_table(text) == text, (
        'README\'s "what runs where" table is stale: run `tokenbus acls --update README.md`'
    )


def test_the_acl_table_names_every_role_and_a_stale_one_is_caught() -> None:
    table = acl_table.markdown_table()
    for role in ("edge", "ingest", "scheduler", "worker"):
        assert f"| {role} (`services/{role}`) |" in table
    fresh = with_block(
        "before\n<!-- acl-table:start -->\n<!-- acl-table:end -->\n", "acl-table", table
    )
    stale = fresh.replace(table.splitlines()[-1] + "\n", "")
    assert stale != fresh
    assert acl_table.with_table(stale) == fresh


def test_a_file_without_the_block_markers_is_a_clear_error() -> None:
    with pytest.raises(MissingBlock, match="acl-table:start"):
        with_block("no markers here", "acl-table", "body")
    with pytest.raises(MissingBlock, match="acl-table:end"):
        with_block("<!-- acl-table:start -->", "acl-table", "body")


def _exists(path: str) -> bool:
    """The file or folder, or a module named with an attribute (`shared/health.with_health`)."""
    folder, _, name = path.rpartition("/")
    module = f"{folder}/{name.split('.')[0]}.py"
    return any((ROOT / p).exists() for p in (path, path + ".py", module))


def test_every_path_the_docs_name_exists() -> None:
    docs = [README, *sorted((ROOT / "docs").glob("*.md"))]
    missing = [
        f"{doc.relative_to(ROOT)}:{n}: {path}"
        for doc in docs
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        for path in DOC_PATH.findall(line)
        if not (path + "/").startswith("bench/out/")  # a benchmark's output, not in git
        and path not in NOT_OURS
        and not _exists(path)
    ]
    assert not missing, "the docs name paths that do not exist:\n" + "\n".join(missing)


def _classes() -> dict[str, set[str]]:
    """Every class of the code (services, shared, tokenbus) -> the names defined in it."""
    found: dict[str, set[str]] = {}
    for folder in ("services", "shared", "tokenbus"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    names = found.setdefault(node.name, set())
                    names.update(
                        n.name
                        for n in node.body
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                    )
    return found


def test_every_class_and_method_the_architecture_page_names_exists() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    classes = _classes()
    named = re.findall(r"`([A-Z][A-Za-z]+)(?:\.([a-z_]+))?`", text)
    assert len(named) > 50  # the walk reads the page's names
    wrong = sorted(
        {
            f"{cls}.{attr}" if attr else cls
            for cls, attr in named
            if cls not in classes or (attr and attr not in classes[cls])
        }
    )
    assert not wrong, f"docs/architecture.md names what the code does not have: {wrong}"


def _adr_statuses() -> dict[str, tuple[str, str]]:
    """ADR number -> (file name, the status its `Status:` line gives)."""
    found = {}
    for path in sorted(DECISIONS.glob("[0-9][0-9][0-9][0-9]-*.md")):
        status = STATUS.search(path.read_text())
        assert status is not None, f"{path.name} has no `Status: accepted...` line"
        found[path.name[:4]] = (path.name, status.group(1))
    return found


def test_every_adr_is_in_the_index_with_its_status() -> None:
    adrs = _adr_statuses()
    rows = {
        num: (link, status)
        for num, link, status in INDEX_ROW.findall((DECISIONS / "README.md").read_text())
    }
    missing = sorted(set(adrs) - set(rows))
    assert not missing, f"ADRs missing from docs/decisions/README.md: {missing}"
    unknown = sorted(set(rows) - set(adrs))
    assert not unknown, f"the ADR index lists ADRs that have no file: {unknown}"
    assert {n: r[0] for n, r in rows.items()} == {n: a[0] for n, a in adrs.items()}, (
        "an index row links to another file than its ADR's"
    )
    assert {n: r[1] for n, r in rows.items()} == {n: a[1] for n, a in adrs.items()}, (
        "the index's status differs from the ADR's `Status:` line"
    )


def test_every_adr_status_names_an_adr_that_exists() -> None:
    adrs = _adr_statuses()
    for num, (_, status) in adrs.items():
        assert re.fullmatch(r"accepted(, (amended by|superseded in part by) \d{4})*", status), (
            f"ADR {num}: status {status!r} is not one of the index's forms"
        )
        for named in re.findall(r"\d{4}", status):
            assert named in adrs, f"ADR {num}: its status names ADR {named}, which has no file"
            assert named > num, f"ADR {num}: its status names an earlier ADR, {named}"


def test_every_setting_says_what_it_is_for() -> None:
    missing = [
        f"{cls.__name__}.{name}"
        for _, cls, _ in _groups()
        for name, field in cls.model_fields.items()
        if not field.description
    ]
    assert not missing, f"settings without a description: {missing}"


def test_readme_starts_with_the_two_commands() -> None:
    text = README.read_text()
    first_block = text.split("```", 2)[1]
    assert "make run" in first_block
    assert "make test" in first_block
    assert "TOKENBUS_WORKER_ENGINE" in markdown_table()
