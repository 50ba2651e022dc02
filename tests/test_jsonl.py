"""common/jsonl.py: the one JSONL reader names the file and line of a bad row, in one line."""

from __future__ import annotations

import pytest

from common.errors import Error, InputFileError
from common.jsonl import read_jsonl


class OwnError(Error):
    pass


def test_rows_and_blank_lines(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text('{"a": 1}\n\n  \n{"a": 2, "b": [1, 2]}\n')
    assert read_jsonl(f) == [{"a": 1}, {"a": 2, "b": [1, 2]}]


@pytest.mark.parametrize("text,line,what", [
    ('{"a": 1}\n{"a": \n', 2, "not valid JSON"),
    ('{"a": 1}\n\n[1, 2]\n', 3, "not a JSON object"),
    ('"x"\n', 1, "not a JSON object"),
])
def test_a_bad_row_is_one_line_naming_file_and_line(tmp_path, text, line, what):
    f = tmp_path / "bad.jsonl"
    f.write_text(text)
    with pytest.raises(OwnError) as e:
        read_jsonl(f, "--input", error=OwnError)
    msg = str(e.value)
    assert msg.startswith(f"--input: {f}:{line}: {what}") and "\n" not in msg, msg


def test_check_reports_its_problem_with_file_and_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "x"}\n{"text": "y"}\n')
    check = lambda row: None if "prompt" in row else "no prompt"  # noqa: E731
    with pytest.raises(InputFileError, match=rf"^{f}:2: no prompt$"):
        read_jsonl(f, check=check)


def test_missing_file_and_bad_encoding(tmp_path):
    with pytest.raises(InputFileError, match="--data: no such file"):
        read_jsonl(tmp_path / "nope.jsonl", "--data")
    f = tmp_path / "latin1.jsonl"
    f.write_bytes('{"t": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(InputFileError, match="is not UTF-8 text"):
        read_jsonl(f)


def test_skip_bad_drops_a_torn_last_row(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert read_jsonl(f, skip_bad=True) == [{"step": 1}, {"step": 2}]
    with pytest.raises(InputFileError, match=":3: not valid JSON"):
        read_jsonl(f)
