"""Configuration errors that used to be found only after the workers had started: each is now one
sentence naming the key, the value and the rule, exit 2, before any worker, W&B run or run
directory exists.

Each case runs the command's own entry point, ``launcher.cli.main()`` with the user's argv, in a
forked copy of this process (the same code as ``python -m launcher ...`` without paying for the
interpreter and its imports again: only the check runs, a second or so); one case also runs as a
real ``python -m launcher`` subprocess.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from helpers.cli import SMALL_RUN, run_launcher

pytestmark = pytest.mark.timeout(120)

SMALL = [*SMALL_RUN, "logger=none"]

BROKEN_YAML = "_target_: launcher.models.GPT\nd_model: [16\nn_head: 2\n"

CASES = [
    (["model.n_head=5"],
     "model.n_head=5 is invalid: it must divide model.d_model=16 (each attention head takes d_model / n_head "
     "features)."),
    (["model.d_model=0"], "model.d_model=0 is invalid: it must be a positive integer."),
    (["model.vocab_size=16"],
     "model.vocab_size=16 is invalid: the data (launcher.models.CharCorpus) has an alphabet of 128 symbols, but the "
     "model's embedding stages.0.tok has only 16 rows; set model.vocab_size to at least 128."),
    (["model.seq_len=32", "data.seq_len=64"],
     "model.seq_len=32 is invalid: the data's sequences are 64 long (data.seq_len=64), but the model's position "
     "embedding stages.0.pos has only 32 rows; set model.seq_len to at least 64 or data.seq_len to at most 32."),
    (["model.lr=fast"], "model.lr=fast is invalid: GPT takes a number for lr."),
    (["model.lr=-1"], "model.lr=-1 is invalid: the learning rate must be a positive number."),
    (["data.val_fraction=1.5"],
     "data.val_fraction=1.5 is invalid: it is the share of the windows held out for validation, from 0 up to (not "
     "including) 1."),
    (["data.val_fraction=0.999"],
     "data.val_fraction=0.999 is invalid here: it holds out 2219 of the 2222 windows of seq_len+1=9 characters, "
     "leaving fewer than one batch (data.batch_size=8) to train on; lower val_fraction."),
    (["seed=-1"],
     "seed=-1 is invalid: the seed must be an integer from 0 to 4294967295 (numpy's range, which seed_everything "
     "seeds too)."),
    (["strategy=single", "model.n_head=5"],
     "model.n_head=5 is invalid: it must divide model.d_model=16 (each attention head takes d_model / n_head "
     "features)."),
    (["--config-dir", "{conf}", "model=bad"],
     "--config-dir={conf}: model/bad.yaml is not valid YAML: expected ',' or ']', but got ':' at line 3, column 7 "
     "(while parsing a flow sequence)."),
    # Hydra's own answers advised a next step that only led to another error (misleading advice)
    (["trainer.max_step=10"],  # Hydra: "To append to your config use +trainer.max_step=10"
     "trainer.max_step=10 is invalid: max_step is not an argument of lightning's Trainer; did you mean "
     "trainer.max_steps?"),
    # a sweep: Hydra's "Key 'max_step' is not in struct" from every point
    (["--multirun", "trainer.max_step=10", "G=1,2"],
     "trainer.max_step=10 is invalid: max_step is not an argument of lightning's Trainer; did you mean "
     "trainer.max_steps?"),
    (["trainer.devices=2"],  # Hydra: "+trainer.devices=2", then "remove trainer.devices"
     "trainer.devices=2 is invalid: the launcher sets devices from W = G*R; remove trainer.devices."),
    (["trainer.gradient_clip_algorithm=norm"],  # a Trainer argument the config lacks: here + is the answer
     "trainer.gradient_clip_algorithm=norm is not in the config: trainer has no key gradient_clip_algorithm; to add "
     "it, write +trainer.gradient_clip_algorithm=norm."),
    (["model.n_layers=1"],  # Hydra: "+model.n_layers=1", then GPT's TypeError
     "model.n_layers=1 is invalid: GPT takes no argument n_layers; did you mean model.n_layer?"),
    (["strategy=gpipe,lpp"],  # Hydra: "Ambiguous value ... use key=[value1,value2]"
     "strategy=gpipe,lpp is a sweep over 2 values: add -m (multirun) to run each."),
    (["memory_limit=2,3"],
     "memory_limit=2,3 is a sweep over 2 values: add -m (multirun) to run each, or write memory_limit=[2,3] for one "
     "list value."),
    # Hydra: three lines, "Are you sure that module 'mymod' is installed?"
    (["model=custom", "model._target_=mymod.MyModel"],
     "model._target_=mymod.MyModel could not be built: there is no module mymod in the working directory ({cwd}) or "
     "on PYTHONPATH; run from the directory that holds mymod.py (or the package mymod/), or add that directory to "
     "PYTHONPATH."),
]


def _main_in_fork(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """``launcher.cli.main()`` with ``argv``, in a forked child: its exit code, stdout and stderr."""
    from launcher import cli

    out, err = cwd / ".stdout", cwd / ".stderr"
    pid = os.fork()
    if pid == 0:  # the child: the command's own entry point, then out without any teardown
        code = 70
        try:
            os.chdir(cwd)
            for fd, path in ((1, out), (2, err)):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            # pytest replaced sys.stdout/sys.stderr with its own capture: write to the files instead
            sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
            sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
            sys.argv = ["launcher", *argv]
            try:
                cli.main()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - reported through the exit code and stderr
            import traceback

            traceback.print_exc()
            code = 71
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.read_text(), err.read_text()


@pytest.fixture(scope="module", autouse=True)
def warm():
    """Every import and the data's first read once, here: each forked check inherits them."""
    from launcher.preflight import preflight as _preflight

    _, found = _preflight([*SMALL, "hydra.run.dir=/nonexistent/never-made"])
    assert not found.fatal, found.fatal


@pytest.fixture(scope="module")
def conf_dir():
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "model").mkdir()
        (Path(d) / "model" / "bad.yaml").write_text(BROKEN_YAML)
        yield Path(d)


@pytest.mark.parametrize("overrides,sentence", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_config_is_one_sentence_exit_2_and_nothing_made(tmp_path, conf_dir, overrides, sentence):
    args = [a.format(conf=conf_dir) for a in overrides]
    run = tmp_path / "run"
    opts, rest = (args[:2], args[2:]) if args[0].startswith("--") else ([], args)  # options before overrides
    code, _, err = _main_in_fork([*opts, *SMALL, *rest, f"hydra.run.dir={run}"], tmp_path)
    assert code == 2, err[-3000:]
    assert err.strip().splitlines() == [f"error: {sentence.format(conf=conf_dir, cwd=os.path.realpath(tmp_path))}"], \
        err[-3000:]
    assert not run.exists()  # no run directory, so no W&B run and no worker either
    assert not (tmp_path / "outputs").exists()


def test_broken_yaml_as_the_user_types_it(tmp_path, conf_dir):
    run = tmp_path / "run"
    p = run_launcher("--config-dir", str(conf_dir), "model=bad", f"hydra.run.dir={run}", cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip().splitlines() == [
        f"error: --config-dir={conf_dir}: model/bad.yaml is not valid YAML: expected ',' or ']', but got ':' at line "
        f"3, column 7 (while parsing a flow sequence)."]
    assert not run.exists()


def test_the_defaults_stay_valid():
    """The new rules refuse nothing a default spells: DDP with its default order and cache, every
    built-in model and data with their defaults, the flagship; nor a key that only has no effect
    under the scheme (an order or a weight cache under DDP: a warning, and the run goes on)."""
    from launcher.preflight import preflight as _preflight

    for overrides in (["strategy=ddp"], ["strategy=ddp", "order=1f1b", "weight_cache=step"], ["strategy=fsdp",
                      "weight_cache=job"], ["strategy=fslpp", "G=4", "R=4"], ["model=mlp"], ["seed=4294967295"],
                      ["strategy=ddp", "order=zb_h1"], ["strategy=ddp", "weight_cache=job"]):
        _, found = _preflight([*overrides, "logger=none"])
        assert not found.fatal, (overrides, found.fatal)
