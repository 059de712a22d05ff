"""Reward functions and their registry.

One signature for every reward (the ``REWARDS`` registry)::

    fn(completions: list[str], **fields: list, **settings) -> list[float] | RewardValues

Every field is a list aligned with ``completions``: always ``prompt``, ``answer`` and ``solution``
(from the ``TaskItem``; ``prompt`` is the task's text, before any chat template), plus every key of
``TaskItem.fields`` (``answer_format``; reasoning-gym items add ``rg_dataset``, ``rg_config``,
``rg_entry``). Functions take ``**_`` for fields they do not use. Completions are the generated
text only (no prompt), special tokens already stripped.

**Settings** (``compute_rewards(settings=...)``, from the ``reward`` config section through
:func:`contained_settings`, e.g. ``judge`` for ``llm_judge``): a function receives the settings its
signature names (all of them if it takes ``**kwargs``), as ``Registry.call`` does.

**Per-sample text beside the value (the side channel)**: a function may return
:class:`RewardValues` ``(values, info={key: list aligned with completions})`` instead of a plain
list, e.g. ``llm_judge``'s written feedback. ``compute_rewards`` collects it into
``RewardResult.info["<reward>/<key>"]`` (``None`` for samples whose reward failed), so the caller
can write it beside each sample (``samples.jsonl``). A ``RewardValues`` is a list, so callers that
only want the values need nothing new.

Facts on ``REWARDS`` entries: ``check(reward_cfg, errors, machine)`` validates the reward's own settings before
anything loads (None = none), like the ``check`` fact of task sources; ``may_hang`` (default True:
plug-ins and unknown code) says whether ``reward.isolation=auto`` runs the reward in a worker process
that a timeout can kill (:mod:`grpo_lab.rewards.isolation`). The cheap built-ins that run every step
say False (``correctness``, ``correctness_binary``, ``format``); ``correctness`` calls reasoning-gym's
scorers, a few of which parse the answer with sympy (countdown, puzzle24), and ``is_correct`` runs the
same scorers here for the metrics anyway, so a worker would not make those tasks hang-proof.

The final answer is read from a completion with the item's answer format
(:mod:`grpo_lab.rewards.answers`): the whole stripped completion for ``plain`` (compact tasks),
after the last ``####`` for ``hash`` (GSM8K-style worked solutions), inside the last
``<answer>...</answer>`` for ``tags``.

Note on ``correctness`` for reasoning-gym items: it is the generator's own scorer, which is NOT
always 0/1. Many scorers give partial credit when the reference is a substring of the answer
(chain_sum: oracle ``28``, answer ``280`` -> 2/3; ``-28`` -> 2/3), and some give 0.01 for any
wrong answer. ``correctness_binary`` is 1.0 exactly when ``correctness`` is 1.0, else 0.0 (a plain
right-or-wrong reward, without partial credit); ``is_correct`` uses the same test.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import json
import logging
import math
import signal
import threading
from collections.abc import Sequence
from typing import Any

from grpo_lab.registry import Registry

from .answers import answer_marked, extract_answer
from .isolation import RewardTimeout, call_in_worker, function_ref

log = logging.getLogger(__name__)

# Facts: `check(reward_cfg, errors, machine)` validates the reward's settings before anything loads (None = none);
# `binary`: every value is 1.0 or 0.0 (what reward.noise.kind=flip needs);
# `may_hang`: reward.isolation=auto runs the reward in a killable worker process (module docstring).
# `prepare(cfg, start) -> stats`: what the reward needs built before the run's first step, with the run's starting
# policy at hand (a learned reward model trains here), None = nothing; `online(cfg) -> object | None`: a part
# that keeps training the reward during the run (after_step, state_dict, close), None = none.
REWARDS = Registry("reward", defaults={"check": None, "binary": False, "may_hang": True, "prepare": None,
                                       "online": None})

# Where reward calls run (reward.isolation): auto = a worker for entries that may hang, here otherwise.
ISOLATION = ("auto", "process", "thread")

# Keys compute_rewards passes itself; TaskItem.fields must not use them.
RESERVED_FIELDS = ("completions", "prompt", "answer", "solution")


class RewardValues(list):
    """A reward function's values plus per-sample extras: ``info`` maps a key to a list aligned with
    the completions (e.g. ``{"feedback": [judge text, ...]}``). Collected by :func:`compute_rewards`
    into ``RewardResult.info`` (module docstring); otherwise just the list of values."""

    def __init__(self, values: Any = (), info: dict[str, list] | None = None):
        super().__init__(values)
        self.info = dict(info or {})


def _fmts(n: int, answer_format: Sequence[str | None] | None) -> list[str]:
    if answer_format is None:
        return ["plain"] * n
    return [f or "plain" for f in answer_format]


@functools.lru_cache(maxsize=64)
def _rg_scorer(name: str, config_json: str):
    """``score_answer`` of a reasoning-gym dataset built with the task's own config.

    Built from the task's dataset_kwargs rather than ``reasoning_gym.get_score_answer_fn(name)``
    (default config): some scorers read their config (puzzle24's value range, decimal_arithmetic's
    precision). size/seed do not affect scoring.
    """
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=1, seed=0, **json.loads(config_json)).score_answer


def _score_rg(name: str, config: dict | None, extracted: str | None, entry: dict) -> float:
    if extracted is None:
        return 0.0
    scorer = _rg_scorer(name, json.dumps(config or {}, sort_keys=True))
    try:
        score = float(scorer(extracted, entry))
    except Exception as e:  # a scorer crashing on odd model output is a wrong answer, not a crash
        log.debug("reasoning-gym %s scorer raised %r on %r", name, e, extracted)
        return 0.0
    return score if math.isfinite(score) else 0.0


@REWARDS.register("correctness", may_hang=False)
def correctness(
    completions: list[str],
    *,
    answer: list[str],
    answer_format: list[str] | None = None,
    rg_dataset: list[str | None] | None = None,
    rg_config: list[dict | None] | None = None,
    rg_entry: list[dict | None] | None = None,
    **_: Any,
) -> list[float]:
    """The reasoning-gym scorer on the extracted answer when the item has an ``rg_entry``
    (may be fractional, see module docstring), else 1.0/0.0 exact match after stripping."""
    n = len(completions)
    fmts = _fmts(n, answer_format)
    out = []
    for i, c in enumerate(completions):
        ext = extract_answer(c, fmts[i])
        entry = rg_entry[i] if rg_entry is not None else None
        if entry is not None:
            name = rg_dataset[i] if rg_dataset is not None and rg_dataset[i] else entry["metadata"]["source_dataset"]
            out.append(_score_rg(name, rg_config[i] if rg_config is not None else None, ext, entry))
        else:
            out.append(1.0 if ext is not None and ext == str(answer[i]).strip() else 0.0)
    return out


@REWARDS.register("correctness_binary", binary=True, may_hang=False)
def correctness_binary(completions: list[str], **fields: Any) -> list[float]:
    """1.0 where ``correctness`` is exactly 1.0, else 0.0 (no partial credit)."""
    return [1.0 if r == 1.0 else 0.0 for r in correctness(completions, **fields)]


# May hang: sympy evaluates what it parses (a huge power runs in C), and math-verify's own timeouts
# use SIGALRM, which only works in a main thread, as the worker's is.
@REWARDS.register("math_verify", may_hang=True, binary=True)
def math_verify_reward(
    completions: list[str], *, answer: list[str], answer_format: list[str] | None = None, **_: Any
) -> list[float]:
    """1.0 if ``math_verify.verify(parse(answer), parse(extracted answer))`` else 0.0.

    Mathematical equivalence rather than string equality: ``0.5`` matches ``1/2`` and
    ``\\frac{1}{2}``, ``288.0`` matches ``288``, ``1,000`` matches ``1000``.
    """
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    fmts = _fmts(len(completions), answer_format)
    out = []
    for i, c in enumerate(completions):
        ext = extract_answer(c, fmts[i])
        if ext is None:
            out.append(0.0)
            continue
        try:
            # A bare LaTeX answer (a \\boxed{} content such as "\\dfrac{1}{3}") parses only inside math
            # delimiters (math-verify's LaTeX extraction looks for $...$ / \\boxed); retry it that way.
            gold = parse(str(answer[i]), parsing_timeout=timeout) or parse(f"${answer[i]}$", parsing_timeout=timeout)
            pred = parse(ext, parsing_timeout=timeout) or parse(f"${ext}$", parsing_timeout=timeout)
            ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout)
        except Exception as e:
            log.debug("math_verify failed on %r vs %r: %r", ext, answer[i], e)
            ok = False
        out.append(1.0 if ok else 0.0)
    return out


@REWARDS.register("format", may_hang=False, binary=True)
def format_reward(completions: list[str], *, answer_format: list[str] | None = None, **_: Any) -> list[float]:
    """1.0 if the completion states its answer in the item's answer format's explicit form, else 0.0.

    Meaningful for worked-solution formats (``hash``: a ``####`` line; ``tags``: an ``<answer>``
    element; ``boxed``: a ``\\boxed{}``) and for the instruct style ``boxed_or_last``, where it asks
    for ``\\boxed{N}``, ``#### N``, ``<answer>N</answer>`` or "The answer is N" rather than a number
    merely appearing (``answers.answer_marked``); for ``plain`` it only says the completion is not blank.
    """
    fmts = _fmts(len(completions), answer_format)
    return [1.0 if answer_marked(c, fmts[i]) else 0.0 for i, c in enumerate(completions)]


def reward_fields(items: Sequence[Any]) -> dict[str, list]:
    """Field lists aligned with ``items``: ``answer``, ``solution`` and every ``TaskItem.fields`` key
    (``None`` where an item lacks a key another item has)."""
    keys: list[str] = []
    for it in items:
        for k in it.fields:
            if k not in keys:
                keys.append(k)
    bad = [k for k in keys if k in RESERVED_FIELDS]
    if bad:
        raise ValueError(f"TaskItem.fields must not use the reserved names {bad} ({RESERVED_FIELDS})")
    fields: dict[str, list] = {"prompt": [it.prompt for it in items], "answer": [it.answer for it in items],
                               "solution": [it.solution for it in items]}
    for k in keys:
        fields[k] = [it.fields.get(k) for it in items]
    return fields


class RewardError(RuntimeError):
    """Too many samples of one step had a failed reward (more than ``reward.max_error_frac``)."""


class RewardResult(tuple):
    """``(total, per_reward)`` (unpacks as before) plus ``.metrics``: the failure counts
    ``reward/errors`` (raised or non-finite), ``reward/timeouts`` and ``reward/failed_frac``; and
    ``.info``: per-sample extras the functions returned (``{"<reward>/<key>": list}``, see
    :class:`RewardValues`)."""

    def __new__(cls, total: list[float], per: dict[str, list[float]], metrics: dict[str, float],
                info: dict[str, list] | None = None):
        self = super().__new__(cls, (total, per))
        self.metrics = metrics
        self.info = dict(info or {})
        return self

    def sample_info(self, i: int) -> dict[str, Any]:
        """The extras of sample ``i`` (e.g. ``{"llm_judge/feedback": "Score: 7/10 ..."}``), to log beside it."""
        return {k: v[i] for k, v in self.info.items()}

    @property
    def total(self) -> list[float]:
        return self[0]

    @property
    def per_reward(self) -> dict[str, list[float]]:
        return self[1]


# Signal that interrupts a reward call in the main thread. Not SIGALRM: math-verify (our
# math_verify reward) times its own parsing with signal.alarm and would cancel our alarm.
_TIMEOUT_SIGNAL = signal.SIGUSR2


@contextlib.contextmanager
def _deadline(timeout_s: float | None):
    """Raise :class:`RewardTimeout` in this thread if the block runs past ``timeout_s`` seconds.

    Main thread (single runs, and Hydra's joblib launcher, whose loky workers run each job in
    their main thread): a timer thread sends ``_TIMEOUT_SIGNAL`` to this thread and the handler
    raises; this also interrupts blocking calls such as ``time.sleep`` (PEP 475 retries them only
    when the handler returns). Any other thread: the timer injects the exception with
    ``PyThreadState_SetAsyncExc``, which takes effect at the next Python bytecode, so a reward stuck
    inside one long C call is only stopped when that call returns. Neither stops every hang: that
    takes a worker process (``reward.isolation``, :mod:`grpo_lab.rewards.isolation`); this path
    serves the rewards run here (the built-in pure ones under ``reward.isolation=auto``).
    """
    if timeout_s is None:
        yield
        return
    done, fired = threading.Event(), threading.Event()
    tid = threading.get_ident()
    in_main = threading.current_thread() is threading.main_thread()

    def handler(signum, frame):
        if fired.is_set() and not done.is_set():
            raise RewardTimeout()

    def fire():
        if done.wait(timeout_s):
            return
        fired.set()
        if in_main:
            signal.pthread_kill(tid, _TIMEOUT_SIGNAL)
        else:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(RewardTimeout))

    old = signal.signal(_TIMEOUT_SIGNAL, handler) if in_main else None
    timer = threading.Thread(target=fire, name="reward-deadline", daemon=True)
    timer.start()
    try:
        yield
    finally:
        done.set()
        timer.join()
        if in_main:
            signal.signal(_TIMEOUT_SIGNAL, old)
        elif fired.is_set():  # clear an injected exception that arrived after the call returned
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)


def _short(x: Any, n: int = 80) -> str:
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."


class _RewardCalls:
    """The calls of one :func:`compute_rewards`: ``self(name, completions, fields)`` calls reward
    ``name`` within ``timeout_s``, in this process or in the worker (``isolation``), with the settings
    its signature names; timeouts in a row are counted per reward (any other outcome ends a streak)."""

    def __init__(self, resolved: dict[str, tuple[Any, bool]], settings: dict[str, Any], *, timeout_s: float | None,
                 isolation: str, max_consecutive_timeouts: int | None):
        if isolation not in ISOLATION:
            raise ValueError(f"reward.isolation={isolation!r}; valid choices: {', '.join(ISOLATION)}")
        self.fns = {name: fn for name, (fn, _) in resolved.items()}
        self.settings, self.timeout_s, self.limit = settings, timeout_s, max_consecutive_timeouts
        # A function that runs in the worker travels there by reference (module and name).
        self.refs = {name: function_ref(fn, name) for name, (fn, may_hang) in resolved.items()
                     if isolation == "process" or (isolation == "auto" and may_hang)}
        self.streak: dict[str, int] = {}

    def __call__(self, name: str, comps: list[str], flds: dict[str, list]) -> Any:
        fn = self.fns[name]
        params = inspect.signature(fn).parameters
        takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
        kwargs = {**flds, **{k: v for k, v in self.settings.items() if takes_all or k in params}}
        self.streak[name], timeouts = 0, self.streak.get(name, 0)
        try:
            if name in self.refs:
                return call_in_worker(self.refs[name], comps, kwargs, self.timeout_s)
            with _deadline(self.timeout_s):
                return fn(comps, **kwargs)
        except RewardTimeout:
            self.streak[name] = timeouts + 1
            raise

    def check_streak(self, name: str) -> None:
        """RewardError when reward ``name`` timed out ``max_consecutive_timeouts`` times in a row."""
        k = self.streak.get(name, 0)
        if self.limit is not None and k >= self.limit:
            raise RewardError(
                f"reward {name!r} timed out {k} times in a row (its batch call, then single samples) at "
                f"reward.timeout_s={self.timeout_s:g}: it hangs rather than runs slowly, so the run stops here "
                f"(reward.max_consecutive_timeouts={self.limit}). Fix the reward function, or raise "
                "reward.timeout_s if it is merely slow")


def _check_len(name: str, vals: Any, m: int) -> list:
    """``vals`` as a list of ``m`` entries; a reward returning anything else is a bug (RuntimeError)."""
    try:
        vals = list(vals)
    except TypeError:
        raise RuntimeError(f"reward {name!r} returned {type(vals).__name__}, not a list of {m} floats") from None
    if len(vals) != m:
        raise RuntimeError(f"reward {name!r} returned {len(vals)} values for {m} completions")
    return vals


def _extras(name: str, raw: Any, m: int) -> dict[str, list]:
    """The per-sample ``info`` columns a reward returned, each checked to hold ``m`` entries."""
    got = getattr(raw, "info", None) or {}
    for key, vals in got.items():
        if len(vals) != m:
            raise RuntimeError(f"reward {name!r} returned info[{key!r}] with {len(vals)} entries for {m} "
                               "completions")
    return got


class _Failures:
    """The failed samples of one :func:`compute_rewards` call: the first failure per sample (for the
    message), the error and timeout counts, and the budget of ``max_error_frac * n`` samples."""

    def __init__(self, completions: list[str], *, on_error: float, max_error_frac: float):
        self.completions, self.n = completions, len(completions)
        self.on_error, self.max_error_frac = on_error, max_error_frac
        self.failed: dict[int, str] = {}  # sample -> first failure
        self.counts = {"errors": 0, "timeouts": 0}
        self.budget = int(max_error_frac * self.n + 1e-9)  # failed samples tolerated

    def fail(self, i: int, name: str, kind: str, detail: str) -> None:
        self.counts[kind] += 1
        self.failed.setdefault(i, f"reward {name!r} on completion {_short(self.completions[i])}: {detail}")

    def one_value(self, name: str, i: int, v: Any) -> float:
        """``v`` as a finite float, or ``on_error`` with sample ``i`` counted as failed."""
        try:
            x = float(v)
        except (TypeError, ValueError):
            self.fail(i, name, "errors", f"returned {_short(v)}, not a number")
            return self.on_error
        if not math.isfinite(x):
            self.fail(i, name, "errors", f"returned {x}")
            return self.on_error
        return x

    def check_budget(self) -> None:
        """RewardError once more samples failed than ``max_error_frac`` tolerates."""
        if len(self.failed) <= self.budget:
            return
        k, n = len(self.failed), self.n
        first = self.failed[min(self.failed)]
        raise RewardError(
            f"reward: {k} of {n} samples ({100 * k / max(n, 1):.1f} %) got no valid reward in this step "
            f"(errors: {self.counts['errors']}, timeouts: {self.counts['timeouts']}), more than "
            f"reward.max_error_frac={self.max_error_frac:g}. First failure: {first}. Fix the reward function, "
            "raise reward.timeout_s if it is merely slow, or raise reward.max_error_frac to tolerate more")

    def metrics(self) -> dict[str, float]:
        return {"reward/errors": float(self.counts["errors"]), "reward/timeouts": float(self.counts["timeouts"]),
                "reward/failed_frac": len(self.failed) / max(self.n, 1)}


def _checked_specs(completions: list[str], items: Sequence[Any],
                   specs: Sequence[tuple[str, float]]) -> list[tuple[str, float]]:
    """``specs`` as ``(name, weight)`` pairs, after checking one item per completion, at least one
    reward, and each reward listed once."""
    n = len(completions)
    if len(items) != n:
        raise ValueError(f"{n} completions but {len(items)} items; pass one item per completion")
    specs = [(str(name), float(w)) for name, w in specs]
    if not specs:
        raise ValueError("no rewards given; list at least one (name, weight), e.g. [('correctness', 1.0)]")
    names = [s[0] for s in specs]
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise ValueError(f"rewards listed more than once: {dup}; give each reward one weight")
    return specs


def _score_each(name: str, call: _RewardCalls, completions: list[str], fields: dict[str, list],
                failures: _Failures, info: dict[str, list], timeout_s: float | None) -> list[float]:
    """Reward ``name`` called per sample, to find the samples its batch call failed on; a failed
    sample gets ``on_error``, and the run stops as soon as the failures exceed the budget or the
    timeouts in a row reach ``max_consecutive_timeouts``."""
    n, vals = len(completions), []
    for i in range(n):
        one = {k: [v[i]] for k, v in fields.items()}
        try:
            raw_one = call(name, [completions[i]], one)
            out = _check_len(name, raw_one, 1)
            vals.append(failures.one_value(name, i, out[0]))
            for key, col in _extras(name, raw_one, 1).items():
                info.setdefault(f"{name}/{key}", [None] * n)[i] = col[0]
        except RewardTimeout:
            failures.fail(i, name, "timeouts", f"ran past reward.timeout_s={timeout_s:g}")
            vals.append(failures.on_error)
        except RuntimeError as e:
            if str(e).startswith(f"reward {name!r} returned"):  # a wrong-shaped return is a bug
                raise
            failures.fail(i, name, "errors", f"{type(e).__name__}: {e}")
            vals.append(failures.on_error)
        except Exception as e:
            failures.fail(i, name, "errors", f"{type(e).__name__}: {e}")
            vals.append(failures.on_error)
        failures.check_budget()
        call.check_streak(name)
    return vals


def _score(name: str, call: _RewardCalls, completions: list[str], fields: dict[str, list],
           failures: _Failures, info: dict[str, list], timeout_s: float | None) -> list[float]:
    """Reward ``name``'s unweighted values: one call on the whole batch, or per sample when it fails."""
    n = len(completions)
    try:
        raw = call(name, completions, fields)
        batch_failure = None
    except RewardTimeout:
        call.check_streak(name)
        batch_failure = f"timed out on the batch (reward.timeout_s={timeout_s:g})"
    except Exception as e:  # contained: found per sample below
        batch_failure = f"{type(e).__name__}: {e}"
    if batch_failure is not None:
        log.warning("reward %r failed on the whole batch (%s); scoring each sample alone", name, batch_failure)
        return _score_each(name, call, completions, fields, failures, info, timeout_s)
    vals = [failures.one_value(name, i, v) for i, v in enumerate(_check_len(name, raw, n))]
    for key, col in _extras(name, raw, n).items():
        info[f"{name}/{key}"] = list(col)
    return vals


def compute_rewards(
    completions: list[str],
    items: Sequence[Any],
    specs: Sequence[tuple[str, float]],
    *,
    timeout_s: float | None = None,
    on_error: float = 0.0,
    max_error_frac: float = 0.0,
    settings: dict[str, Any] | None = None,
    isolation: str = "thread",
    max_consecutive_timeouts: int | None = None,
    resolved: dict[str, tuple[Any, bool]] | None = None,
) -> RewardResult:
    """Weighted sum of reward functions, with failures contained.

    ``items[i]`` is the ``TaskItem`` that ``completions[i]`` answers (repeat each item G times for
    a group of G samples). ``specs`` is ``[(reward name, weight), ...]``; each name at most once; a
    name is registered (``REWARDS``) or a plug-in ``"package.module:function"``.
    Returns ``(total, per_reward)`` with ``total[i] = sum_k weight_k * per_reward[name_k][i]`` and
    ``per_reward`` holding the unweighted values; ``.metrics`` counts the failures.

    Containment: each function is called once on the whole batch, within ``timeout_s``.
    If that call raises or times out, it is called again per sample (each within ``timeout_s``) to
    find the failing samples. A sample whose value could not be computed (raised, timed out,
    NaN/inf or not a number) gets ``on_error`` as that function's value. When more than
    ``max_error_frac`` of the samples failed, :class:`RewardError` is raised (as soon as that is
    certain, so a function hanging on every sample costs about ``max_error_frac * n + 1`` timeouts,
    not ``n``), and so is it when one function's calls time out ``max_consecutive_timeouts`` times
    in a row (the batch call, then single samples): a reward that hangs on everything fails the run
    after that many timeouts, not after one per tolerated sample. A function returning the wrong
    number of values is a bug and raises at once. ``settings`` reach the functions whose signature
    names them (module docstring).

    ``isolation`` (``ISOLATION``): where each call runs. ``thread``: here, stopped by ``_deadline``
    (not inside a C call, nor a sleep outside the main thread). ``process``: in a worker process
    killed at the timeout (:mod:`grpo_lab.rewards.isolation`). ``auto``: the worker for entries
    whose ``may_hang`` fact is true, here for the others.

    ``resolved``: :func:`resolve_rewards` of ``specs``, for a caller that scores every step with the same
    rewards (:class:`RewardScorer`); looked up here when not given.
    """
    n = len(completions)
    specs = _checked_specs(completions, items, specs)
    resolved = resolved if resolved is not None else resolve_rewards(specs)
    fields = reward_fields(items)
    settings = dict(settings or {})
    clash = sorted(set(settings) & set(fields))
    if clash:
        raise ValueError(f"reward settings {clash} have the names of per-sample fields; rename them")
    call = _RewardCalls(resolved, settings, timeout_s=timeout_s, isolation=isolation,
                        max_consecutive_timeouts=max_consecutive_timeouts)
    completions = list(completions)
    failures = _Failures(completions, on_error=on_error, max_error_frac=max_error_frac)
    info: dict[str, list] = {}
    total = [0.0] * n
    per: dict[str, list[float]] = {}
    for name, w in specs:
        vals = _score(name, call, completions, fields, failures, info, timeout_s)
        failures.check_budget()
        per[name] = vals
        total = [t + w * v for t, v in zip(total, vals)]
    return RewardResult(total, per, failures.metrics(), info)


def resolve_rewards(specs: Sequence[tuple[str, float]]) -> dict[str, tuple[Any, bool]]:
    """Each reward name of ``specs`` -> (its function: registered, or a plug-in 'package.module:function'
    imported now; its ``may_hang`` fact)."""
    return {name: (REWARDS.get(name), REWARDS.fact(name, "may_hang")) for name, _ in specs}


class RewardScorer:
    """``scorer(completions, items) -> RewardResult``: a ``reward`` section's weighted functions (``specs``,
    by default its ``weights``) under its containment settings, looked up and resolved once for a run that
    scores every step (:func:`compute_rewards`)."""

    def __init__(self, reward_cfg: Any, specs: Sequence[tuple[str, float]] | None = None):
        self.specs = list(reward_cfg.weights.items() if specs is None else specs)
        self.settings = contained_settings(reward_cfg)
        self.resolved = resolve_rewards(self.specs)

    def __call__(self, completions: list[str], items: Sequence[Any]) -> RewardResult:
        return compute_rewards(completions, items, self.specs, resolved=self.resolved, **self.settings)


def contained_settings(reward_cfg: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`compute_rewards` from a ``reward`` config section (``settings``:
    the sections reward functions read, e.g. ``judge`` for ``llm_judge``, as plain dicts)."""
    from grpo_lab.schema import as_dict

    return {"timeout_s": reward_cfg.timeout_s, "on_error": float(reward_cfg.on_error),
            "max_error_frac": float(reward_cfg.max_error_frac), "isolation": reward_cfg.isolation,
            "max_consecutive_timeouts": reward_cfg.max_consecutive_timeouts,
            # Resolved (${cache_dir} and the like) and plain, for a reward worker process.
            "settings": {"judge": as_dict(reward_cfg.judge), "reward_model": as_dict(reward_cfg.reward_model)}}


def is_correct(completion: str, item: Any) -> bool:
    """True when the ``correctness`` reward of ``completion`` for ``item`` is exactly 1.0."""
    return correctness([completion], **reward_fields([item]))[0] == 1.0
