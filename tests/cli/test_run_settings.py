"""The run's settings (:class:`~launcher.schedule.run_settings.RunSettings`: checkpoint format and
async mode, ``nonfinite``, ``timeout``, ``runtime.transport``) are one typed object, checked once
where they enter: a bad value is the same one sentence from ``UnifiedStrategy``'s keywords and from
the command line (exit 2, before any worker starts), and ``runtime.transport`` reaches the engine."""

from __future__ import annotations

import dataclasses
import json

import pytest

from helpers.cli import SMALL_RUN, run_launcher
from launcher.config import ConfigError
from launcher.lightning import UnifiedStrategy
from launcher.preflight import preflight as _preflight
from launcher.schedule.run_settings import DEFAULT_RUN, CheckpointSettings, RunSettings

pytestmark = pytest.mark.timeout(240)

#: (command-line overrides, the same values as UnifiedStrategy's keywords, the one sentence both say)
BAD = [
    (["checkpoint.format=shardd"], dict(checkpoint={"format": "shardd"}),
     "checkpoint.format=shardd is invalid: use sharded (each stage's owner writes it), single (one file) or null "
     "(the scheme's default)."),
    (["checkpoint.async_mode=asynch"], dict(checkpoint={"async_mode": "asynch"}),
     "checkpoint.async_mode=asynch is invalid: use disabled or async."),
    (["+checkpoint.fromat=sharded"], dict(checkpoint={"fromat": "sharded"}),
     "checkpoint.fromat=sharded is invalid: checkpoint.fromat is not a known key; did you mean checkpoint.format?"),
    (["nonfinite=skp"], dict(nonfinite="skp"),
     "nonfinite=skp is invalid: use stop (a NaN or infinite loss or gradient stops the run) or skip (that step is "
     "dropped)."),
    (["timeout=0"], dict(timeout=0), "timeout=0 is invalid: the failure timeout must be a positive number of seconds."),
    (["runtime.transport=tcp"], dict(transport="tcp"),
     "runtime.transport=tcp is invalid: use auto (shared memory between workers on one host's CPUs, else the "
     "backend's), gloo (the backend's point-to-point) or shm (shared memory)."),
    (["fault.restarts=-1"], dict(fault={"restarts": -1}),
     "fault.restarts=-1 is invalid: the number of lost workers to recover from must be a non-negative integer "
     "(0: a failure ends the run)."),
    (["fault.copies=2"], dict(fault={"restarts": 1, "copies": 2}),
     "fault.copies=2 is invalid: use 0 (no copies) or 1 (each stage held by one worker copied to the next worker "
     "after every step)."),
    (["+fault.restart=1"], dict(fault={"restart": 1}),
     "fault.restart=1 is invalid: fault.restart is not a known key; did you mean fault.restarts?"),
]


@pytest.mark.parametrize("overrides,keywords,sentence", BAD, ids=[c[0][0] for c in BAD])
def test_a_bad_run_setting_is_one_sentence_from_python_and_the_command_line(overrides, keywords, sentence):
    with pytest.raises(ConfigError) as e:
        UnifiedStrategy("lpp", G=1, R=2, stages=4, microbatches=4, **keywords)
    assert e.value.sentences == [sentence]
    _, found = _preflight(overrides)
    assert found.fatal == [sentence]


def test_the_command_line_refuses_them_with_exit_2_before_any_worker(tmp_path):
    run = tmp_path / "run"
    # every value of BAD but the misspelt key (which the pre-check names alone, before Hydra composes)
    typed = [o for o, _, _ in BAD if not o[0].startswith("+")]
    p = run_launcher(*[o[0] for o in typed], "logger=none", f"hydra.run.dir={run}", cwd=tmp_path, timeout=60)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip().splitlines() == ["error: " + s for o, _, s in BAD if o in typed]
    assert not run.exists()  # no run directory: nothing started


def test_python_takes_the_typed_object_or_the_plain_values():
    typed = RunSettings(checkpoint=CheckpointSettings(format="sharded", async_mode="async"), nonfinite="skip",
                        timeout=5, transport="gloo")
    plain = UnifiedStrategy("lpp", G=1, R=2, stages=4, microbatches=4, nonfinite="skip", timeout=5,
                            transport="gloo", checkpoint={"format": "sharded", "async_mode": "async"})
    assert plain.run == typed and UnifiedStrategy(run=typed).run is typed
    assert plain.timeout == 5.0 and plain.checkpoint_format == "sharded"
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.timeout = 1  # type: ignore[misc]
    with pytest.raises(TypeError, match="not both"):
        UnifiedStrategy(run=typed, nonfinite="stop")
    # the defaults, from the one place they are written; format None is the scheme's
    assert UnifiedStrategy("fsdp", stages=4, microbatches=4).run == DEFAULT_RUN
    assert UnifiedStrategy("fsdp", stages=4, microbatches=4).checkpoint_format == "sharded"
    assert UnifiedStrategy("lpp", G=1, R=2, stages=4, microbatches=4).checkpoint_format == "single"
    with pytest.raises(ConfigError, match="give the transport as transport="):
        UnifiedStrategy("lpp", G=1, R=2, stages=4, microbatches=4, runtime={"transport": "gloo"})


@pytest.mark.parametrize("transport", ["gloo"])
def test_runtime_transport_from_the_command_line_trains_and_is_recorded(tmp_path, transport):
    # lpp on R=2 workers: activations and their gradients cross between the two, over the transport chosen
    run = tmp_path / "run"
    p = run_launcher(*SMALL_RUN, "strategy=lpp", "G=1", "R=2", "trainer.max_steps=2", "logger=none",
                     f"runtime.transport={transport}", f"hydra.run.dir={run}", cwd=tmp_path, timeout=200)
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.loads((run / "metrics.json").read_text())
    assert m["transport"] == {"setting": transport, "used": transport}
    assert len(m["steps"]) == 2 and m["config"]["runtime"]["transport"] == transport


def test_copies_without_restarts_are_refused_in_one_sentence():
    """The copies serve a recovery inside the job: ``fault.copies=1`` alone would cost memory and
    traffic for nothing, so it is refused, the same from Python and the command line."""
    sentence = ("fault.copies=1 is invalid with fault.restarts=0: the copies are what a recovery inside the job "
                "takes lost stages from, so set fault.restarts to 1 or more, or fault.copies=0.")
    with pytest.raises(ConfigError) as e:
        UnifiedStrategy("fsdp", stages=4, microbatches=4, fault={"copies": 1})
    assert e.value.sentences == [sentence]
    _, found = _preflight(["fault.copies=1"])
    assert found.fatal == [sentence]
    # with restarts, fsdp's default single-file checkpoint is no longer required to be sharded: copies recover it
    assert UnifiedStrategy("fsdp", stages=4, microbatches=4, fault={"restarts": 1, "copies": 1},
                           checkpoint={"format": "single"}).run.fault.copies == 1


def test_a_replacement_where_it_cannot_work_is_refused_in_one_sentence(tmp_path):
    """``fault.replace=true`` needs a restart left (a replacement is forked per restart) and a state
    to start from: a survivor's whole state (ddp, lpp with R=1) or the last sharded checkpoint.
    Refused the same from Python and the command line (exit 2, nothing started)."""
    no_restart = ("fault.replace=true is invalid with fault.restarts=0: a replacement process is forked for a lost "
                  "worker only while a restart is left, so set fault.restarts to 1 or more, or fault.replace=false.")
    no_state = ("fault.replace=true is invalid with strategy=fsdp G=4 R=1 and checkpoint.format=single "
                "checkpoint.async_mode=disabled: a replacement process starts from a survivor's whole state "
                "(strategy=ddp, or strategy=lpp with R=1) or from the last sharded checkpoint, so set "
                "checkpoint.format=sharded and checkpoint.async_mode=disabled, or fault.replace=false.")
    with pytest.raises(ConfigError) as e:
        UnifiedStrategy("ddp", stages=4, microbatches=4, fault={"replace": True})
    assert e.value.sentences == [no_restart]
    _, found = _preflight(["fault.replace=true"])
    assert found.fatal == [no_restart]
    # fault.copies=1 would let fsdp recover onto the survivors, but a replacement needs a whole state
    _, found = _preflight(["strategy=fsdp", "G=4", "microbatches=4", "fault.restarts=1", "fault.replace=true",
                           "fault.copies=1", "checkpoint.format=single"])
    assert found.fatal == [no_state]
    assert UnifiedStrategy("ddp", stages=4, microbatches=4, fault={"restarts": 1, "replace": True}).run.fault.replace
    run = tmp_path / "run"
    p = run_launcher("fault.replace=true", "logger=none", f"hydra.run.dir={run}", cwd=tmp_path, timeout=60)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip().splitlines() == ["error: " + no_restart]
    assert not run.exists()
