"""grpo_lab.atomic_dir: a directory appears whole or not at all (checkpoints and cached models)."""

import pytest

from grpo_lab.atomic_dir import write_dir_atomically


def test_a_failed_write_leaves_the_target_as_it_was_and_no_temporary_directory(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")

    def write(tmp):
        (tmp / "half.txt").write_text("half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed mid-write"):
        write_dir_atomically(final, write)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in final.iterdir()) == ["old.txt"]


def test_an_existing_target_is_replaced_unless_it_is_to_be_kept(tmp_path):
    final = tmp_path / "nested" / "out"
    assert write_dir_atomically(final, lambda tmp: (tmp / "a.txt").write_text("1")) == final
    write_dir_atomically(final, lambda tmp: (tmp / "b.txt").write_text("2"))
    assert sorted(p.name for p in final.iterdir()) == ["b.txt"]
    write_dir_atomically(final, lambda tmp: (tmp / "c.txt").write_text("3"), keep_existing=lambda p: True)
    assert sorted(p.name for p in final.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in final.parent.iterdir()) == ["out"]
