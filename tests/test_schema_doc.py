"""The workload reference (docs/workloads.md) and the CSV column reference (docs/results.md) are generated
from the validation models and the columns' declaration, and cannot drift; the README holds neither."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchbackend import columns
from benchbackend.cli import main
from benchbackend.spec import schema
from benchbackend.spec.layers import LAYER_CLASSES

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
WORKLOADS = ROOT / schema.PAGE  # docs/workloads.md
RESULTS = ROOT / columns.PAGE  # docs/results.md


def test_the_docs_hold_the_generated_reference() -> None:
    """Fails when a field is added, renamed or given another default without regenerating
    docs/workloads.md: run `benchbackend schema --update`."""
    assert schema.PAGE == "docs/workloads.md"
    text = WORKLOADS.read_text(encoding="utf-8")
    assert schema.current_block(text) == schema.block(), "run: benchbackend schema --update"


def test_each_reference_is_in_one_place_only() -> None:
    """The README links to the references and holds no copy that could go stale; each docs page holds
    its own reference once."""
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    holders = {p.relative_to(ROOT).as_posix(): (p.read_text(encoding="utf-8").count(schema.BEGIN),
                                                int(columns.holds_block(p.read_text(encoding="utf-8"))))
               for p in pages}
    assert {k: v for k, v in holders.items() if v != (0, 0)} == {schema.PAGE: (1, 0), columns.PAGE: (0, 1)}
    readme = README.read_text(encoding="utf-8")
    assert f"]({schema.PAGE})" in readme and f"]({columns.PAGE})" in readme


def _documented(markdown: str, section: str) -> set[str]:
    heading = "#### Top level" if section == "(top level)" else f"#### `{section}`"
    part = markdown.split(heading + "\n", 1)[1].split("\n#### ", 1)[0]
    return set(re.findall(r"^\| `([a-z_]+)` \|", part, re.M))


def test_every_field_of_every_model_is_documented() -> None:
    text = schema.markdown()
    for section, model in schema.SECTIONS:
        assert _documented(text, section) == set(model.model_fields), section
    layers = text.split("#### Layers (`model[]`)", 1)[1]
    for kind, cls in LAYER_CLASSES.items():
        part = layers.split(f"`type: {kind}`\n", 1)[1].split("\n`type: ", 1)[0].split("\n#### ", 1)[0]
        fields = set(re.findall(r"^\| `([a-z_]+)` \|", part, re.M))
        assert fields == set(cls.model_fields) - {"type", "name", "inputs"}, kind


def _row(text: str, section: str, field: str) -> list[str]:
    heading = "#### Top level" if section == "(top level)" else f"#### `{section}`"
    part = text.split(heading + "\n", 1)[1] if section else text
    line = next(ln for ln in part.splitlines() if ln.startswith(f"| `{field}` |"))
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_types_defaults_and_allowed_values_are_the_models() -> None:
    text = schema.markdown()
    assert _row(text, "inference", "batch_size")[1:4] == ["integer", "`128`", "> 0"]
    assert _row(text, "(top level)", "description")[2] == '`""`'
    optimizer = _row(text, "training", "optimizer")
    assert optimizer[2] == "required" and optimizer[3] == "`sgd`, `adam`, `rmsprop`"
    assert _row(text, "data", "dataset")[3] == "`mnist`, `cifar10`, `synthetic`, `npz`, `tokens`, `text`"
    conv = text.split("`type: conv2d`", 1)[1]
    assert _row(conv, "", "stride")[1:3] == ["integer", "`1`"]  # `stride`, not `strides`
    assert "`relu`" in _row(conv, "", "activation")[3] and "`softmax`" in _row(conv, "", "activation")[3]
    assert _row(text, "checks", "parity_tolerance")[3] == "keys: `fp64`, `tf32`, `bf16`, `fp16`"
    assert _row(text, "(top level)", "name")[3].endswith("matches `^[A-Za-z0-9._-]+$`")


def test_every_note_names_a_field() -> None:
    """The hand-written notes (for fields whose model has no description) follow the models."""
    known = set()
    for section, model in schema.SECTIONS:
        key = section.rsplit(".", 1)[-1]
        known |= {f"{key}.{name}" for name in model.model_fields}
    for kind, cls in LAYER_CLASSES.items():
        known |= {f"{kind}.{name}" for name in cls.model_fields}
    assert set(schema.NOTES) <= known, set(schema.NOTES) - known


def test_schema_command_prints_the_reference_and_updates_a_file(tmp_path: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(main, ["schema"])
    assert out.exit_code == 0 and out.output == schema.markdown()
    assert "Markdown" in runner.invoke(main, ["schema", "--help"]).output
    doc = tmp_path / "README.md"
    doc.write_text(f"intro\n{schema.BEGIN}\nstale\n{schema.END}\nrest\n", encoding="utf-8")
    done = runner.invoke(main, ["schema", "--update", str(doc)])
    assert done.exit_code == 0, done.output
    assert doc.read_text(encoding="utf-8") == f"intro\n{schema.block()}\nrest\n"
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n", encoding="utf-8")
    failed = runner.invoke(main, ["schema", "--update", str(bare)])
    assert failed.exit_code == 2 and "markers are missing" in failed.output


def test_update_rewrites_whichever_reference_a_file_holds(tmp_path: Path) -> None:
    """A page with only the column markers (docs/results.md) is updated, one with both too, a stale
    column marker (the one that named README.md) is found and rewritten, and a file without markers
    among several fails before any file is written."""
    runner = CliRunner()
    only_columns = tmp_path / "results.md"
    stale = "<!-- BEGIN column reference (generated: benchbackend schema --update README.md) -->"
    only_columns.write_text(f"intro\n{stale}\nold\n{columns.END}\nrest\n", encoding="utf-8")
    both = tmp_path / "both.md"
    both.write_text(f"{schema.BEGIN}\nx\n{schema.END}\n{columns.BEGIN}\ny\n{columns.END}\n", encoding="utf-8")
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n", encoding="utf-8")
    failed = runner.invoke(main, ["schema", "--update", str(only_columns), "--update", str(bare)])
    assert failed.exit_code == 2 and "markers are missing" in failed.output
    assert stale in only_columns.read_text(encoding="utf-8")  # nothing written
    done = runner.invoke(main, ["schema", "--update", str(only_columns), "--update", str(both)])
    assert done.exit_code == 0, done.output
    assert only_columns.read_text(encoding="utf-8") == f"intro\n{columns.block()}\nrest\n"
    assert both.read_text(encoding="utf-8") == f"{schema.block()}\n{columns.block()}\n"
    assert "updated the workload reference and the column reference" in done.output


def test_update_without_a_file_rewrites_the_docs_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`benchbackend schema --update` is the documented command: it rewrites docs/workloads.md and
    docs/results.md of the checkout (here a copy), and says so when they are not there."""
    from benchbackend import cli

    (tmp_path / "docs").mkdir()
    (tmp_path / schema.PAGE).write_text(f"a\n{schema.BEGIN}\nstale\n{schema.END}\n", encoding="utf-8")
    (tmp_path / columns.PAGE).write_text(f"b\n{columns.BEGIN}\nstale\n{columns.END}\n", encoding="utf-8")
    monkeypatch.setattr(cli, "_CHECKOUT", tmp_path)
    done = CliRunner().invoke(main, ["schema", "--update"])
    assert done.exit_code == 0, done.output
    assert (tmp_path / schema.PAGE).read_text(encoding="utf-8") == f"a\n{schema.block()}\n"
    assert (tmp_path / columns.PAGE).read_text(encoding="utf-8") == f"b\n{columns.block()}\n"
    monkeypatch.setattr(cli, "_CHECKOUT", tmp_path / "elsewhere")
    missing = CliRunner().invoke(main, ["schema", "--update"])
    assert missing.exit_code == 2 and "--update FILE" in missing.output


def test_a_changed_model_changes_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import Field, create_model

    from benchbackend.spec.workload import InferenceSpec

    changed = create_model("InferenceSpec", __base__=InferenceSpec,
                           batch_size=(int, Field(default=64, gt=0)))
    sections = tuple((s, changed if m is InferenceSpec else m) for s, m in schema.SECTIONS)
    monkeypatch.setattr(schema, "SECTIONS", sections)
    assert _row(schema.markdown(), "inference", "batch_size")[2] == "`64`"
    assert schema.block() != schema.current_block(WORKLOADS.read_text(encoding="utf-8"))


def test_the_docs_hold_the_generated_column_reference() -> None:
    """The CSV's columns are declared once (``columns.DECLARED``); docs/results.md's table is generated
    from there: run `benchbackend schema --update` after adding one."""
    from benchbackend import results

    assert columns.PAGE == "docs/results.md"
    text = RESULTS.read_text(encoding="utf-8")
    assert columns.current_block(text) == columns.block(), "run: benchbackend schema --update"
    assert results.COLUMNS == [c.name for c in columns.DECLARED]
    assert all(f"| `{name}` |" in columns.markdown() for name in results.COLUMNS)
    assert max(c.version for c in columns.DECLARED) == results.SCHEMA_VERSION
    assert set(results.NUMERIC) == {c.name for c in columns.DECLARED if c.kind == "number"} - {"schema_version"}
