"""A worker lost at a chosen (rank, step), recovered inside the job (``fault.restarts``): the
survivors re-form the group in the same processes, redo the interrupted step under the re-planned
scheme, and end with the parameters of an uninterrupted run.

Float64 at the launcher's defaults: gradient clipping 1.0, dropout on (the oracle is one device's
``strategy=single``, whose micro-batches draw from the random streams as the schemes' do), the
user's own ``DataLoader(shuffle=True)`` with ``drop_last=False``. The failure is real: the chosen
worker sends itself ``SIGKILL`` (or ``SIGSTOP``: a hang, which the launcher names and kills) at the
start of the chosen step, in the first generation only; nothing may be left running afterwards.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest

from helpers.faults import (
    CLIP,
    TOL,
    LoseIn,
    LoseInSharedReduce,
    LoseWorker,
    left_running,
    lose_in_shared_reduce,
    read_records,
)
from helpers.training import Regressor, max_diff, quiet_trainer, user_loader
from launcher.config import ConfigError
from launcher.lightning import UnifiedStrategy
from launcher.lightning.single import StreamedSingleDevice
from launcher.runtime import WorkerFailed
from launcher.runtime.recovery import current_membership

pytestmark = pytest.mark.timeout(400)

STEPS, B = 4, 4


def fit(strategy: Any, devices: int, callbacks: list | None = None, steps: int = STEPS, **trainer: Any) -> dict:
    L.seed_everything(0, verbose=False)
    model = Regressor(max_steps=steps).double()
    tr = quiet_trainer(strategy, devices, precision="64-true", max_steps=steps, gradient_clip_val=CLIP,
                       **{"limit_val_batches": 0, "callbacks": callbacks or [], **trainer})
    tr.fit(model, train_dataloaders=user_loader())
    return model.state_dict()


@pytest.fixture(scope="module")
def oracle() -> dict:
    return fit(StreamedSingleDevice(microbatches=B), 1)


# the quick check's case (``-m "not slow"``); test_fault_matrix.py runs every fault under every scheme
@pytest.mark.parametrize(("scheme", "rank", "step", "sig"), [("ddp", 3, 2, signal.SIGKILL)])
def test_a_lost_worker_is_recovered_and_training_equals_an_uninterrupted_run(
        scheme: str, rank: int, step: int, sig: int, oracle: dict, tmp_path: Path) -> None:
    strategy = UnifiedStrategy(scheme, stages=4, microbatches=B, fault={"restarts": 1})
    state = fit(strategy, 4, [LoseWorker(rank, step, sig, tmp_path)])
    diff = max_diff(oracle, state)
    survivors = sorted(int(p.stem[4:]) for p in tmp_path.glob("rank*.txt"))
    records = [eval(p.read_text()) for p in sorted(tmp_path.glob("rank*.txt"))]  # noqa: S307 - our own repr
    print(f"{scheme}: rank {rank} lost at step {step} ({signal.Signals(sig).name}); {records[0]}; "
          f"parameters within {diff:.1e} of one device")
    assert survivors == [r for r in range(4) if r != rank]
    assert all(len(r) == 1 and r[0]["lost_ranks"] == [rank] and r[0]["step"] == step for r in records)
    assert records[0][0]["scheme_after"] == "lpp G=3 R=1 (W=3)"
    assert diff < TOL
    assert not [p for p in mp.active_children() if p.name.startswith("launcher-worker")]


def test_a_worker_lost_inside_the_shared_reduce_is_recovered(oracle: dict, monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    """ddp on one host's CPUs reduces its gradients through shared memory (transport auto): a worker
    killed there, the others waiting in it for its sum, is a lost peer as over gloo (recovered)."""
    lose_in_shared_reduce(monkeypatch)
    strategy = UnifiedStrategy("ddp", stages=4, microbatches=B, fault={"restarts": 1})
    state = fit(strategy, 4, [LoseInSharedReduce(3, 2, tmp_path)])
    records = read_records(tmp_path)
    assert sorted(records) == [0, 1, 2]
    assert all(len(r) == 1 and r[0]["lost_ranks"] == [3] and r[0]["step"] == 2 for r in records.values()), records
    assert max_diff(oracle, state) < TOL
    assert not left_running()


#: steps of the runs with a replacement: the loader's 5 batches (the 5th short), then the next epoch's first
REPLACED_STEPS = 6


@pytest.fixture(scope="module")
def oracle6() -> dict:
    return fit(StreamedSingleDevice(microbatches=B), 1, steps=REPLACED_STEPS)


@pytest.mark.parametrize(("scheme", "rank", "step", "sig", "source", "steps_lost"), [
    # the state of a survivor (each holds every stage), handed over in memory; rank 0 itself, at the next
    # epoch's first batch (after the short last batch). The other schemes and faults: test_fault_matrix.py
    ("ddp", 0, 6, signal.SIGKILL, "memory", 0),
])
def test_a_fresh_process_replaces_a_lost_worker_and_training_equals_an_uninterrupted_run(
        scheme: str, rank: int, step: int, sig: int, source: str, steps_lost: int, oracle6: dict,
        tmp_path: Path) -> None:
    """``fault.replace``: rank ``rank`` killed (or stopped) as step ``step`` begins; a spare process
    takes its rank, every process enters ``fit`` again from the survivors' state (or the last sharded
    checkpoint, every 2 steps), and the run goes on under the user's scheme on W=4, ending with one
    device's parameters; every process, the replacement included, lists the recovery."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    strategy = UnifiedStrategy(scheme, stages=4, microbatches=B, fault={"restarts": 1, "replace": True}, timeout=3)
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    started = time.monotonic()
    state = fit(strategy, 4, [saves, LoseWorker(rank, step, sig, tmp_path)], steps=REPLACED_STEPS,
                enable_checkpointing=True)
    diff = max_diff(oracle6, state)
    records = {int(p.stem[4:]): eval(p.read_text()) for p in tmp_path.glob("rank*.txt")}  # noqa: S307
    print(f"{scheme}: rank {rank} replaced at step {step}: {records[0]}; parameters within {diff:.1e} of one "
          f"device; {time.monotonic() - started:.1f} s")
    assert sorted(records) == [0, 1, 2, 3]  # the replacement among them
    assert all(r == records[0] for r in records.values())
    (r,) = records[0]
    assert (r["replaced"], r["lost_ranks"], r["step"], r["steps_lost"], r["workers"]) == (
        [rank], [rank], step, steps_lost, [4, 4])
    assert r["scheme_before"] == r["scheme_after"] == f"{scheme} G=4 R=1 (W=4)"
    assert r["from"].startswith(source)
    assert diff < TOL
    assert not [p for p in mp.active_children() if p.name.startswith(("launcher-worker", "launcher-spare"))]


def test_a_scheme_it_cannot_recover_is_refused_before_any_worker_starts() -> None:
    with pytest.raises(ConfigError) as e:
        fit(UnifiedStrategy("gpipe", stages=4, microbatches=B, fault={"restarts": 1}, checkpoint={"format": "single"}),
            4)
    assert e.value.sentences == [
        "fault.restarts=1 is invalid with strategy=gpipe G=1 R=4 and checkpoint.format=single "
        "checkpoint.async_mode=disabled: a stage held by one worker is recovered from the last sharded checkpoint, "
        "so set checkpoint.format=sharded and checkpoint.async_mode=disabled (or use strategy=ddp, or strategy=lpp "
        "with G>1 or R=1, recovered from memory), or fault.copies=1, or fault.restarts=0."]


def test_a_loss_before_the_first_checkpoint_ends_the_run_naming_it(tmp_path: Path) -> None:
    """fsdp (each stage on one worker) loses rank 2 at step 2, before any checkpoint: the lost stage
    is nowhere, so the run ends, its sentence naming the lost rank and why, and nothing is left running."""
    with pytest.raises(WorkerFailed, match=r"after the loss of rank 2 \(rank 2 failed .*killed by SIGKILL\)\), a stage "
                                           r"was held only by the lost worker and no sharded checkpoint was written"):
        fit(UnifiedStrategy("fsdp", stages=4, microbatches=B, fault={"restarts": 1}, timeout=5), 4,
            [LoseWorker(2, 2, signal.SIGKILL, tmp_path)])
    assert not [p for p in mp.active_children() if p.name.startswith("launcher-worker")]


def test_each_loss_takes_a_restart_and_one_too_many_ends_the_run_naming_it(oracle: dict, tmp_path: Path) -> None:
    """Two losses (rank 3 at step 2, then rank 0 at step 3): ``fault.restarts=2`` recovers both
    (W 4 -> 3 -> 2) and still equals one device; ``fault.restarts=1`` recovers the first and ends
    the run at the second, naming that rank, with nothing left running."""
    strategy = UnifiedStrategy("ddp", stages=4, microbatches=B, fault={"restarts": 2})
    state = fit(strategy, 4, [LoseWorker(3, 2, signal.SIGKILL, tmp_path, more=((0, 3),))])
    records = eval((tmp_path / "rank1.txt").read_text())  # noqa: S307 - our own repr
    assert [(r["lost_ranks"], r["step"], r["scheme_after"]) for r in records] == [
        ([3], 2, "lpp G=3 R=1 (W=3)"), ([0], 3, "lpp G=2 R=1 (W=2)")]
    assert max_diff(oracle, state) < TOL
    with pytest.raises(WorkerFailed, match=r"^rank 0 failed while running .*killed by SIGKILL"):
        fit(UnifiedStrategy("ddp", stages=4, microbatches=B, fault={"restarts": 1}), 4,
            [LoseWorker(3, 2, signal.SIGKILL, tmp_path, more=((0, 3),))])
    assert not [p for p in mp.active_children() if p.name.startswith("launcher-worker")]


def test_a_loss_during_validation_is_recovered(oracle: dict, tmp_path: Path) -> None:
    """A loss met in a validation step is recovered as in a training step (the validation batch
    redone; the parameters still equal one device's, validation changing none)."""
    L.seed_everything(0, verbose=False)
    model = Regressor(max_steps=STEPS).double()
    tr = quiet_trainer(UnifiedStrategy("ddp", stages=4, microbatches=B, fault={"restarts": 1}, timeout=5), 4,
                       precision="64-true", max_steps=STEPS, gradient_clip_val=CLIP, val_check_interval=2,
                       limit_val_batches=1,
                       callbacks=[LoseIn("validation"), LoseWorker(9, 0, signal.SIGKILL, tmp_path)])
    # an unshuffled validation loader: validating draws nothing from the training order's generator
    tr.fit(model, train_dataloaders=user_loader(), val_dataloaders=user_loader(shuffle=False))
    records = eval((tmp_path / "rank0.txt").read_text())  # noqa: S307 - our own repr
    assert [(r["lost_ranks"], r["step"]) for r in records] == [([2], 3)]  # after step 2's validation began
    assert max_diff(oracle, model.state_dict()) < TOL


def lose_in_the_write(monkeypatch: pytest.MonkeyPatch, rank: int, step: int) -> None:
    """Rank ``rank`` sends itself ``SIGKILL`` in the middle of writing step ``step``'s checkpoint, in
    the first generation: a single file after some of its bytes are in the temporary file (rank 0
    writes it), a sharded one as DCP writes this rank's shard (between DCP's collectives)."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    import launcher.lightning.checkpoint_io as checkpoint_io

    def lost(path: Any) -> bool:
        m = current_membership()
        return m is not None and m.generation == 0 and m.rank == rank and f"step={step}." in str(path)

    replacing, write_data = checkpoint_io.replacing, dcp_fs._FileSystemWriter.write_data

    @contextlib.contextmanager
    def half_then_lost(path: Any, *args: Any, **kwargs: Any) -> Any:
        with replacing(path, *args, **kwargs) as f:
            if lost(path):
                f.write(b"half a checkpoint")
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            yield f

    def lost_in_dcp(self: Any, *args: Any, **kwargs: Any) -> Any:
        if lost(self.path):
            os.kill(os.getpid(), signal.SIGKILL)
        return write_data(self, *args, **kwargs)

    monkeypatch.setattr(checkpoint_io, "replacing", half_then_lost)  # the forked workers inherit both
    monkeypatch.setattr(dcp_fs._FileSystemWriter, "write_data", lost_in_dcp)


# a loss in a save's hook (on_save_checkpoint), every scheme: test_fault_matrix.py
@pytest.mark.parametrize(("scheme", "where", "rank", "steps_lost"), [
    ("ddp", "write", 0, 0),  # the writer itself lost halfway through the file
    ("fsdp", "write", 2, 2),  # lost inside DCP's write, between its collectives
    # the clipping's own all-reduce: ddp has none (every worker holds the reduced gradient), so lpp G=2 R=2
    # (state from a replica) and gpipe (from the step-2 checkpoint, step 3 replayed)
    ("lpp", "clip", 2, 0), ("gpipe", "clip", 2, 1)])
def test_a_loss_outside_a_step_is_recovered_and_what_it_interrupted_redone(
        scheme: str, where: str, rank: int, steps_lost: int, oracle: dict, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank ``rank`` lost inside step 4's checkpoint save (in a hook, or in the middle of the write),
    or in the clipping's own all-reduce of step 4 (checkpoints every 2 steps, all kept): the save
    (or the step) is redone after the recovery, every
    checkpoint on disk is whole (none half-written, no temporary left), the step-4 one holds the
    final parameters, and those equal one device's."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from helpers.training import load_checkpoint
    from launcher.lightning.checkpoint_io import AtomicCheckpointIO

    if where == "write":
        lose_in_the_write(monkeypatch, rank, 4)
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    L.seed_everything(0, verbose=False)
    model = Regressor(max_steps=STEPS).double()
    sizes = {"G": 2, "R": 2} if scheme == "lpp" else {}
    tr = quiet_trainer(UnifiedStrategy(scheme, stages=4, microbatches=B, fault={"restarts": 1}, **sizes), 4,
                       precision="64-true", max_steps=STEPS, gradient_clip_val=CLIP, limit_val_batches=0,
                       enable_checkpointing=True, plugins=[AtomicCheckpointIO()],  # the command line's writer
                       callbacks=[saves, LoseIn(where, 4, rank), LoseWorker(9, 0, signal.SIGKILL, tmp_path)])
    tr.fit(model, train_dataloaders=user_loader())
    records = eval((tmp_path / f"rank{1 if rank == 0 else 0}.txt").read_text())  # noqa: S307 - our own repr
    diff = max_diff(oracle, model.state_dict())
    print(f"{scheme}, a loss in {where}: {records}; parameters within {diff:.1e} of one device")
    during = "the clipping's all-reduce" if where == "clip" else "a checkpoint save"
    assert [(r["lost_ranks"], r["during"], r["steps_lost"]) for r in records] == [([rank], during, steps_lost)]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert max_diff(model.state_dict(), load_checkpoint(tmp_path / "ckpt" / "epoch=0-step=4.ckpt")["state_dict"]) == 0
    assert diff < TOL
    assert not [p for p in mp.active_children() if p.name.startswith("launcher-worker")]


def test_a_second_loss_during_recovery_with_no_restart_left_ends_the_run_naming_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Rank 3 is lost at step 2; while the survivors re-form the group, rank 1 is killed too (as it
    starts to rejoin). With one restart the run ends within the timeout, naming rank 1, and nothing is
    left running. (With ``fault.restarts=2`` the second loss is folded into the recovery, W 4 -> 2:
    test_fault_matrix.py, under every scheme.)"""
    from helpers.faults import lose_while_rejoining

    lose_while_rejoining(monkeypatch, 1)
    with pytest.raises(WorkerFailed, match=r"^rank 1 failed while running .*killed by SIGKILL"):
        fit(UnifiedStrategy("ddp", stages=4, microbatches=B, fault={"restarts": 1}, timeout=5), 4,
            [LoseWorker(3, 2, signal.SIGKILL, tmp_path)])
    assert not left_running()


def test_a_survivor_a_step_behind_takes_the_state_of_the_others(oracle: dict, monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """Rank 3 dies right after step 3's last all-reduce (ddp's loss and flag, waited for in
    ``_agreed_locally``) completed; ranks 0 and 1 finish
    step 3 and meet the loss in step 4, while rank 2 meets it in step 3 itself, after that
    all-reduce and before its update (as when an all-reduce completes on some ranks and fails on
    others, which no callback can place). Rank 2 takes the state after step 3 from rank 0 and ends
    its step without an update; the run still equals one device."""
    import launcher.lightning.strategy as strategy_module

    real = strategy_module.UnifiedStrategy._agreed_locally
    calls = {"n": 0}

    def agree_then_fail(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        m = current_membership()
        if m is not None and m.generation == 0:
            calls["n"] += 1
            if calls["n"] == 3 and m.rank == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            if calls["n"] == 3 and m.rank == 2:
                time.sleep(0.5)  # the launcher has seen rank 3 die: this is what gloo says to rank 2 then
                raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")
        return out

    # the forked workers inherit it
    monkeypatch.setattr(strategy_module.UnifiedStrategy, "_agreed_locally", agree_then_fail)
    state = fit(UnifiedStrategy("ddp", stages=4, microbatches=B, fault={"restarts": 1}), 4,
                [LoseWorker(9, 0, signal.SIGKILL, tmp_path)])  # LoseWorker only writes the records here
    records = {int(p.stem[4:]): eval(p.read_text()) for p in tmp_path.glob("rank*.txt")}  # noqa: S307
    assert sorted(records) == [0, 1, 2]
    assert all(r[0]["step"] == 4 and r[0]["moved_stages"] == 4 for r in records.values()), records
    assert max_diff(oracle, state) < TOL


#: a user's model on the command line (``model=custom``) that loses rank 2 at the start of step 4
LOSSY = '''
import os
import signal

from launcher.models import GPT
from launcher.runtime import WorkerFailed
from launcher.runtime.recovery import current_membership


class LossyGPT(GPT):
    def on_train_batch_start(self, batch, batch_idx):
        m = current_membership()  # None on one device: the oracle trains it undisturbed
        if m is not None and m.generation == 0 and m.rank == 2 and self.trainer.global_step + 1 == 4:
            os.kill(os.getpid(), signal.SIGKILL)
'''


@pytest.mark.slow
@pytest.mark.parametrize(("scheme", "d_model", "source", "steps_lost", "replace"),
                         [("ddp", 16, "memory", 0, False), ("ddp", 96, "memory", 0, False),
                          ("fsdp", 16, "checkpoint", 1, False), ("ddp", 16, "memory", 0, True)])
def test_the_command_line_recovers_and_equals_strategy_single(scheme: str, d_model: int, source: str, steps_lost: int,
                                                              replace: bool, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m launcher strategy=<scheme> G=4 fault.restarts=1``: rank 2 killed at step 4 of 5,
    a checkpoint every 2 steps (sharded under fsdp, the step-2 one its source); the run exits 0,
    says so in one line, lists the recovery in ``metrics.json``, leaves no process, and its
    ``last.ckpt`` equals ``strategy=single`` on the same config within 1e-10. With
    ``fault.replace=true`` a fresh process takes rank 2 and the run goes on under ddp on 4 workers.

    Under ddp the root of the step's small last gradient bucket fails on the lost rank's message,
    while the others wait for its reply; a collective in flight on gloo's thread meanwhile hung the
    recovery (``Replicas.finish``): at ``d_model=16`` (one bucket, through the root) the loss's
    all-reduce launched with the buckets, at ``d_model=96`` (also a bucket on gloo's ring, launched
    during the backward) that ring's all-reduce."""
    from helpers.cli import SMALL_RUN, run_launcher, survivors
    from helpers.oracle import single_device
    from helpers.training import last_state

    (tmp_path / "lossy.py").write_text(LOSSY)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = ["model=custom", "model._target_=lossy.LossyGPT", "model.vocab_size=128", "model.seq_len=8",
             f"model.d_model={d_model}", "model.n_head=2", "model.n_layer=2", "model.max_steps=5"]
    overrides = [*SMALL_RUN, *model, "trainer.max_steps=5", "trainer.precision=64-true", "trainer.val_check_interval=2",
                 "trainer.limit_val_batches=1", "logger=none", "png=false"]
    run = tmp_path / "run"
    p = run_launcher(f"strategy={scheme}", "G=4", "fault.restarts=1", f"fault.replace={str(replace).lower()}",
                     *overrides, f"hydra.run.dir={run}", cwd=tmp_path, timeout=300, pythonpath="cwd")
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [x for x in p.stderr.splitlines() if "recovered from the loss of rank 2 at step 4" in x]
    assert len(lines) == 1, p.stderr[-3000:]
    print(lines[0])
    recoveries = json.loads((run / "metrics.json").read_text())["recoveries"]
    after = "ddp G=4 R=1 (W=4)" if replace else "lpp G=3 R=1 (W=3)"
    assert [(r["lost_ranks"], r["step"], r["steps_lost"], r["scheme_after"]) for r in recoveries] == [
        ([2], 4, steps_lost, after)]
    assert recoveries[0].get("replaced") == ([2] if replace else None)
    assert recoveries[0]["from"].startswith(source)
    assert not survivors(str(run))
    got, want = last_state(run), single_device(overrides)
    diff = max((got[k].double() - want[k].double()).abs().max().item() for k in want)
    print(f"command line, {scheme} W=4 -> {4 if replace else 3}: last.ckpt within {diff:.1e} of strategy=single")
    assert diff < TOL


def test_recoveries_reach_the_wandb_summary_and_one_row_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The summary counts the recoveries, their seconds and steps lost; an offline W&B run, read back
    from its ``.wandb`` file, holds the ``recovery_events`` table with one row per recovery."""
    import wandb

    from launcher.report.wandb_log import RECOVERY_COLUMNS, log_summary, summary_of
    from launcher.report.wandb_read import find_runs, read_run

    pm = {"predicted": 1.0, "measured": 1.0}
    recoveries = [{"generation": 1, "step": 3, "seconds": 0.5, "steps_lost": 0, "lost_ranks": [2], "workers": [4, 3],
                   "cause": "rank 2 failed", "during": "a training step", "from": "memory"},
                  {"generation": 2, "step": 5, "seconds": 1.0, "steps_lost": 2, "lost_ranks": [0], "workers": [3, 2],
                   "cause": "rank 0 failed", "during": "a checkpoint save", "from": "checkpoint c"}]
    metrics = {"latency_s": pm, "throughput_samples_per_s": pm, "bubble_fraction": pm, "per_worker": {},
               "recoveries": recoveries}
    got = summary_of(metrics)
    assert (got["recoveries"], got["recovery_s"], got["recovery_steps_lost"]) == (2, 1.5, 2)
    assert "recoveries" not in summary_of({**metrics, "recoveries": []})
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(dir=str(tmp_path), project="recoveries")
    log_summary(run, metrics, tmp_path)
    run.finish()
    # wandb's service may still be writing the offline file when finish() returns (seen here, under
    # load, about one time in three): read it until the logged record is there
    deadline = time.monotonic() + 30
    while True:
        r = read_run(find_runs(tmp_path)[0])
        logged = [h for h in r.history if "recovery_events/path" in h]
        if logged or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(logged) == 1, r.history
    table = json.loads((Path(r.dir) / "files" / logged[0]["recovery_events/path"]).read_text())
    assert table["columns"] == RECOVERY_COLUMNS
    assert [(row[1], row[2], row[5]) for row in table["data"]] == [(3, 0.5, "a training step"),
                                                                  (5, 1.0, "a checkpoint save")]
