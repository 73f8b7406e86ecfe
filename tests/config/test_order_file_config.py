"""order=file from the command line: a schedule file is checked before any worker starts (one
sentence, naming order.path), runs as written, and mode=simulate's order.export writes one."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.config import ConfigError, to_schedule
from launcher.config.validate import errors
from launcher.modes.simulation import simulate_config
from launcher.schedule import make_schedule, simulate
from launcher.schedule.order_file import write_schedule

LPP = ["strategy=lpp", "G=1", "R=2", "stages=4", "microbatches=4"]


@pytest.fixture
def csv_file(tmp_path: Path) -> Path:
    tl = simulate(make_schedule("lpp", 4, 4, 1, 2, order="interleaved_1f1b"))
    return write_schedule(tl.schedule.space, tl.sequences, tmp_path / "il.csv")


def test_file_order_runs_as_written(cfg_of, csv_file: Path) -> None:
    c = cfg_of(*LPP, "order.name=file", f"order.path={csv_file}")
    assert errors(c) == []
    tl, summary = simulate_config(c)
    ref = simulate(make_schedule("lpp", 4, 4, 1, 2, order="interleaved_1f1b"))
    assert tl.sequences == ref.sequences and tl.finish == ref.finish and summary["latency"] == ref.latency


@pytest.mark.parametrize("overrides,expected", [
    (["order.name=file"], "order.path is missing: order=file reads each worker's job sequence from a file"),
    (["order.name=file", "order.path=/no/such/file.csv"], "order.path=/no/such/file.csv cannot be read: No such file"),
    (["order.name=1f1b", "order.path=x.csv"], "order.path=x.csv is invalid with order=1f1b"),
])
def test_bad_file_settings_are_one_sentence(cfg_of, overrides, expected) -> None:
    found = errors(cfg_of(*LPP, *overrides))
    assert len(found) == 1 and found[0].startswith(expected), found


def test_unparsable_and_misplaced_files(cfg_of, csv_file: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("w0: F0.b0  hello\n")
    found = errors(cfg_of(*LPP, "order.name=file", f"order.path={bad}"))
    assert len(found) == 1 and found[0].startswith(f"order.path={bad} is not a schedule file: 'hello' is not an action")
    # the file's placement is lpp R=2's; gpipe on 4 workers computes stage 2 on worker 2
    c = cfg_of("strategy=gpipe", "G=1", "R=4", "stages=4", "microbatches=4", "order.name=file",
               f"order.path={csv_file}")
    with pytest.raises(ConfigError) as e:
        to_schedule(c)
    assert e.value.sentences == [f"order.path={csv_file} puts job F2.b0 on worker 0, but the scheme computes it on "
                                 f"worker 2."]
    with pytest.raises(ConfigError, match="split_backward=true"):
        to_schedule(cfg_of(*LPP, "split_backward=true", "order.name=file", f"order.path={csv_file}"))


def test_export_writes_what_order_file_reads(cfg_of, tmp_path: Path) -> None:
    from launcher.modes.simulation import report_simulation

    for name in ("ours.txt", "torch.csv"):
        out = tmp_path / name
        c = cfg_of(*LPP, "order=zb_h1", f"order.export={out}", "png=false")
        tl, summary = simulate_config(c)
        report_simulation(c, tl, summary, tmp_path)
        back, _ = simulate_config(cfg_of(*LPP, "split_backward=true", "order.name=file", f"order.path={out}"))
        assert back.sequences == tl.sequences and back.start == tl.start
