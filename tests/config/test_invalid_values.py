"""Random invalid values at every key of the schema, through every entry point that
exists: the command line's validation path (the pre-check before Hydra, then the composed
config's rules) and the Python API (``make_schedule``). No traceback anywhere; each bad value is one
sentence naming the key and the value, and the same sentence from each entry point."""

from __future__ import annotations

import math
import os
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import launcher.config  # noqa: F401  (registers the schema and the resolver)
from launcher.config import check_overrides, errors
from launcher.schedule import StepError, make_schedule, rules

# each composed config costs ~0.1 s: enough examples to visit every key several times, no more
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                             HealthCheck.function_scoped_fixture])
#: every bad input tried, ``key=value`` as typed (``COUNT_BAD_INPUTS=file`` writes them there)
TRIED: set[str] = set()
# words a config takes as values: YAML's null, inf and nan, the boolean spellings OmegaConf accepts
# (split_backward=n is False), and option names
RESERVED = {"true", "false", "yes", "no", "on", "off", "y", "n", "null", "inf", "nan", "none", "classic", "auto",
            "step", "job", "simulate", "train"}
API_BASE = dict(strategy="lpp", stages=8, microbatches=16, G=2, R=4, order="1f1b", warmup=None,
                durations={"F": 1.0, "B": 1.0, "I": 0.5, "W": 0.5}, comm=0.0, memory_limit=None, split_backward=False)


@pytest.fixture(scope="module", autouse=True)
def write_tried():
    """``COUNT_BAD_INPUTS=file``: every bad input tried, once the module's tests are done."""
    yield
    if os.environ.get("COUNT_BAD_INPUTS"):
        with open(os.environ["COUNT_BAD_INPUTS"], "a") as f:
            f.writelines(x + "\n" for x in sorted(TRIED))


def spell(v: object) -> str:
    """A Python value as a user types it on the command line."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(spell(x) for x in v) + "]"
    return str(v)


def cli(cfg_of, overrides: list[str]) -> list[str]:
    """What ``python -m launcher <overrides>`` reports: the pre-check's sentences, else the rules'."""
    return check_overrides(overrides) or errors(cfg_of(overrides))


def api(**kw) -> list[str]:
    try:
        make_schedule(**{**API_BASE, **kw})
    except StepError as e:
        return e.sentences
    return []


words = st.text(string.ascii_lowercase, min_size=1, max_size=8).filter(lambda w: w not in RESERVED)
halves = st.integers(-4, 6).map(lambda n: n + 0.5)
bad_size = st.one_of(st.integers(-5, 0), halves, words)
bad_time = st.one_of(st.integers(-4, 0).map(float), st.sampled_from([math.inf, -math.inf, math.nan]), words)
bad_comm = st.one_of(st.integers(-4, -1).map(float), st.sampled_from([math.inf, -math.inf, math.nan]), words)
bad_limit = st.one_of(st.integers(-3, 0), halves, words,
                      st.lists(st.integers(-2, 3), min_size=8, max_size=8).filter(lambda xs: min(xs) <= 0),
                      st.lists(st.integers(1, 3), min_size=1, max_size=5))
#: key -> invalid values; the API's keyword and how it takes the value (None: command line only)
KEYS = {
    "G": (bad_size, lambda v: {"G": v}),
    "R": (bad_size, lambda v: {"R": v}),
    "stages": (bad_size, lambda v: {"stages": v}),
    "microbatches": (bad_size, lambda v: {"microbatches": v}),
    **{f"durations.{k}": (bad_time, lambda v, k=k: {"durations": {**API_BASE["durations"], k: v}}) for k in "FBIW"},
    "comm": (bad_comm, lambda v: {"comm": v}),
    "memory_limit": (bad_limit, lambda v: {"memory_limit": v}),
    "warmup": (words, lambda v: {"warmup": v}),
    "split_backward": (words, lambda v: {"split_backward": v}),
    "strategy": (words, lambda v: {"strategy": v}),
    "order": (words, lambda v: {"order": v}),
    "W": (st.one_of(st.integers(-3, 7), st.integers(9, 20), words), None),
    "prefetch": (st.one_of(st.integers(-5, -1), halves, words), None),
    "weight_cache": (words, None),
    "png": (st.one_of(words, st.integers(-2, 5)), None),
    "mode": (words, None),
}


@st.composite
def bad_values(draw):
    key = draw(st.sampled_from(sorted(KEYS)))
    return key, draw(KEYS[key][0])


@SETTINGS
@given(kv=bad_values())
def test_every_bad_value_is_one_sentence_and_the_same_from_every_entry_point(cfg_of, kv):
    key, v = kv
    typed = f"{key}={spell(v)}"
    TRIED.add(typed)
    said = cli(cfg_of, [typed])
    assert len(said) == 1, (typed, said)
    if key in ("strategy", "order", "mode"):
        assert said[0].startswith(f"{typed} is not a known {key}; "), said
    else:
        assert said[0].startswith(f"{typed} is invalid: "), said
    take = KEYS[key][1]
    if take is not None:  # the launcher's own strategies (auto, single) are named after the API's sentence
        assert api(**take(v)) == [s.split("; the launcher also takes")[0].rstrip(".") + "." for s in said], typed
    elif key in ("prefetch", "weight_cache"):  # the engine's constructor checks these with the same rule
        assert rules.value_error(key, v) == said[0]


sizes = st.sampled_from([1, 1, 2, 3, 4, 6, 5000])


@settings(SETTINGS, max_examples=40)
@given(strategy=st.sampled_from(["ddp", "fsdp", "gpipe", "lpp", "fslpp"]), G=sizes, R=sizes, S=sizes, B=sizes)
def test_rules_between_keys_read_the_same_from_every_entry_point(cfg_of, strategy, G, R, S, B):
    typed = [f"strategy={strategy}", f"G={G}", f"R={R}", f"stages={S}", f"microbatches={B}"]
    said = cli(cfg_of, typed)
    assert said == api(strategy=strategy, G=G, R=R, stages=S, microbatches=B)
    if said:
        TRIED.add(" ".join(typed))
