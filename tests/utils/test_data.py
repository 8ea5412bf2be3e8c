"""Prompt sets ship inside the package; only $SPECMOE_DATA_DIR may point elsewhere."""

from __future__ import annotations

import shutil

import pytest

from specmoe.utils import data


@pytest.mark.parametrize("dataset,rows", [("spec_bench", 480), ("mt_bench", 80), ("gsm8k", 1319)])
def test_packaged_prompt_sets_load_without_any_setting(monkeypatch, dataset, rows):
    monkeypatch.delenv(data.DATA_ENV, raising=False)
    assert len(data.load_prompts(dataset)) == rows
    assert data.find_data_dir() == data.PACKAGE_DATA_DIR


def test_packaged_licenses_ship_beside_the_data():
    names = {p.name for p in data.PACKAGE_DATA_DIR.iterdir()}
    assert {"LICENSE.spec_bench.txt", "LICENSE.fastchat.txt", "LICENSE.gsm8k.txt"} <= names


def test_parent_folders_are_not_searched(monkeypatch, tmp_path):
    """A prompt folder in a parent of the working directory is ignored: only the package copy
    is read."""
    fake = tmp_path / "shared" / "data"
    fake.mkdir(parents=True)
    (fake / "spec_bench_questions.jsonl").write_text(
        '{"question_id": 1, "category": "decoy", "turns": ["decoy"]}\n')
    workdir = tmp_path / "a" / "b"
    workdir.mkdir(parents=True)
    monkeypatch.chdir(workdir)
    monkeypatch.delenv(data.DATA_ENV, raising=False)
    assert data.find_data_dir() == data.PACKAGE_DATA_DIR
    assert "decoy" not in {p.category for p in data.load_prompts("spec_bench")}


def test_env_override_is_read(monkeypatch, tmp_path):
    shutil.copy(data.PACKAGE_DATA_DIR / "mt_bench_questions.jsonl", tmp_path)
    (tmp_path / "spec_bench_questions.jsonl").write_text(
        '{"question_id": 1, "category": "mine", "turns": ["my question"]}\n')
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path))
    assert [p.text for p in data.load_prompts("spec_bench")] == ["my question"]


def test_env_override_without_the_data_names_the_bad_value(monkeypatch, tmp_path):
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        data.load_prompts("spec_bench")
