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


def test_a_whole_step_prints_as_written_and_a_misplaced_action_exits_2(cfg_of, tmp_path: Path) -> None:
    """mode=simulate's actions.txt of a whole step in our text is the file (a receive moved earlier
    stays there); one whose receive stands after the job that needs it is refused in one sentence,
    exit 2, before anything is written."""
    from rich.console import Console

    from helpers.cli import run_launcher
    from launcher.modes.simulation import print_program
    from launcher.schedule.actions import format_programs
    from launcher.schedule.lowering import lower_actions

    tl = simulate(make_schedule("lpp", 4, 4, 1, 2, order="interleaved_1f1b"))
    progs = [list(p) for p in lower_actions(tl, "step", 1)]
    recv = max(n for n, a in enumerate(progs[1]) if a.op == "RECV_ACT")
    moved = [progs[0], [progs[1][recv], *progs[1][:recv], *progs[1][recv + 1:]]]
    path = tmp_path / "step.txt"
    path.write_text(format_programs(moved) + "\n")
    c = cfg_of(*LPP, "order.name=file", f"order.path={path}")
    got, _ = simulate_config(c)
    print_program(got, "step", 1, tmp_path, Console(quiet=True))
    assert (tmp_path / "actions.txt").read_text() == path.read_text()
    late = [progs[0], [*progs[1][:recv], *progs[1][recv + 1:], progs[1][recv]]]
    path.write_text(format_programs(late) + "\n")
    with pytest.raises(ConfigError) as e:
        simulate_config(c)
    (sentence,) = e.value.sentences
    assert sentence.startswith(f"order.path={path}: worker 1 position {len(progs[1]) - 1} is {progs[1][recv]!r}, "
                               "after ") and sentence.endswith("a receive is posted no later than just before the "
                                                               "job that needs it.")
    run = tmp_path / "run"
    p = run_launcher("mode=simulate", *LPP, "order=file", f"order.path={path}", f"hydra.run.dir={run}", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [f"error: {sentence}"], p.stderr[-2000:]
    assert not (run / "actions.txt").exists()
