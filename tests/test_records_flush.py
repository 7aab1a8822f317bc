"""When a run's records are rewritten during training: right after the first logged step, then
every ``FLUSH_SECONDS``, stretched in a long run so the rewrites keep to ``WRITE_SHARE`` of the time."""

import pytest

from gradrepro.records import writer
from gradrepro.records.writer import WRITE_SHARE, Records


@pytest.mark.parametrize("write", [0.01, 0.5])
def test_the_period_is_stretched_by_a_long_write(monkeypatch, tmp_path, write):
    monkeypatch.setenv("GRADREPRO_FLUSH_SECONDS", "10")
    now = [1000.0]
    real_write = writer.atomic_write

    def slow_write(path, save):  # each of the two files takes half of ``write`` seconds
        now[0] += write / 2
        return real_write(path, save)

    monkeypatch.setattr(writer.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(writer, "atomic_write", slow_write)
    records = Records(tmp_path)
    assert records.due()  # nothing written yet
    records.add_scalars({"step": 0, "loss": 1.0})
    records.flush()
    assert (tmp_path / "scalars.parquet").exists()
    period = max(10.0, write / WRITE_SHARE)  # 10 s, or 50 s after a write of half a second
    now[0] += period - 1
    assert not records.due()
    now[0] += 2
    assert records.due()


def test_period_zero_writes_at_every_logged_step(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADREPRO_FLUSH_SECONDS", "0")
    records = Records(tmp_path)
    records.add_scalars({"step": 0, "loss": 1.0})
    records.flush()
    assert records.due()
