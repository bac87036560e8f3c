"""``gf.whatif(...)``: replay the problem checkpoint under several optimizers / mixtures, side by side.

The flow (design, "Comparing runs", ``whatif``):

1. check the data files and the arms (one-line errors, before the model loads);
2. load the checkpoint offline (:func:`gradforensics.replay.checkpoint.load_checkpoint`),
   pack each source's batches once, seeded (:func:`gradforensics.replay.data.load_batches`),
   print the size estimate of all the arms' stores and refuse when the disk is too small;
3. per arm: a fresh load, K steps on the shared batches, every step recorded
   (:func:`gradforensics.runs.train.run_arm`) into ``DIR/<arm>.zarr``;
4. analyse every store (:func:`gradforensics.analyze`), compare each arm with the
   baseline arm (:func:`gradforensics.reporting.comparison.compare_findings`, written
   as ``DIR/compare/<arm>/`` like ``gradforensics compare``), the arm-to-arm
   cosines per layer (:mod:`gradforensics.runs.cosines`), and write the
   what-if report (:mod:`gradforensics.runs.render`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from gradforensics.errors import SpecError, WhatIfInterrupted
from gradforensics.replay.plan import DEFAULT_SKETCH, BatchSpec, ModelSpec, RecordSpec, as_spec, check_disk, plan_record
from gradforensics.runs.arms import Arm, parse_arms, schedule
from gradforensics.runs.result import WhatIf
from gradforensics.store.backends import STORE_SUFFIXES

if TYPE_CHECKING:
    from dask.distributed import Client

    from gradforensics.runs.train import ArmRun

__all__ = ["whatif"]

#: A what-if longer than this many steps per arm is refused before anything is planned or allocated.
MAX_STEPS = 1_000_000


def _stores(out: Path, arms: Sequence[Arm], suffix: str, overwrite: bool) -> dict[str, Path]:
    if suffix not in STORE_SUFFIXES:
        raise SpecError(f"store_suffix must be {', '.join(STORE_SUFFIXES[:-1])} or {STORE_SUFFIXES[-1]}; "
                        f"got {suffix!r}.")
    paths = {a.name: out / f"{a.name}{suffix}" for a in arms}
    for p in paths.values():
        if p.exists() and not overwrite:
            raise SpecError(f"{p} already exists; pass --overwrite to replace it, or choose another --out.")
    return paths


def _needs(plans: Mapping[str, list[tuple[str, int]]], names: Sequence[str]) -> dict[str, int]:
    """Batches to draw per source: the most any arm takes (at least one, so every source is checked)."""
    return {s: max([1] + [j + 1 for plan in plans.values() for src, j in plan if src == s]) for s in names}


def whatif(checkpoint: str | os.PathLike[str], data: Mapping[str, Any] | Sequence[str], arms: Sequence[str],
           steps: int, out: str | os.PathLike[str], *, mixtures: Sequence[str] = (), baseline: str | None = None,
           batches: BatchSpec | Mapping[str, Any] | None = None, record: RecordSpec | Mapping[str, Any] | None = None,
           model: ModelSpec | Mapping[str, Any] | None = None, optimizer_state: str | os.PathLike[str] | None = None,
           store_suffix: str = ".zarr", overwrite: bool = False, force: bool = False, compare_reports: bool = True,
           only: str | Sequence[str] | None = None, client: Client | None = None, progress: bool = True,
           log: IO[str] | None = None, threads: int | None = None, **options: Any) -> WhatIf:
    """Train *steps* steps from *checkpoint* once per arm on identical batches; record, analyse, compare.

    Parameters
    ----------
    checkpoint
        A Hugging Face model directory, or a state-dict file with ``model_factory``
        (and ``tokenizer``), as for ``gradforensics capture``.
    data
        ``{"zh": "zh.jsonl", ...}`` or ``["zh=zh.jsonl", ...]``.
    arms
        ``["hi=adamw:lr=3e-3", "lo=adamw:lr=3e-4", "lion=lion:lr=3e-5,beta2=0.99"]``;
        options: ``lr`` (required), the optimizer's own (``beta1``, ``beta2``, ``eps``,
        ``weight_decay``, ``momentum``, ``nesterov``, ...), ``warmup`` (steps of linear
        warmup) and ``clip`` (max global gradient norm; 0 = off).
    steps
        Optimizer steps per arm (K).
    out
        Directory: ``<arm>.zarr`` per arm, ``report.html``, ``report.md``,
        ``whatif.json``, ``tables/``, ``figures/``, ``compare/<arm>/``.
    mixtures
        ``["nozh=en:1,code:1"]``: the source weights of an arm (default: every
        source, weight 1, round-robin).
    baseline
        The arm every other arm is compared with (default: the first).
    batches, record, model
        ``capture``'s option groups (:mod:`gradforensics.replay.plan`), each a spec or
        a dict of its fields: :class:`~gradforensics.replay.plan.BatchSpec` (its
        ``batches_per_source`` is not used: every arm takes *steps* batches),
        :class:`~gradforensics.replay.plan.RecordSpec` (default here: a
        :data:`~gradforensics.replay.plan.DEFAULT_SKETCH`-long sketch per tensor and
        head; ``sketch=None`` keeps whole tensors), :class:`~gradforensics.replay.plan.ModelSpec`.
    optimizer_state
        An optimizer state file; default ``optimizer.pt`` next to the weights if
        there is one; ``"none"`` starts every arm fresh.
    compare_reports
        Also write ``compare/<arm>/`` (the ``gradforensics compare`` report) per arm.
    only
        Run only these analyses on each arm's store (``"oscillation,conflict"``);
        default all, as ``gf.analyze``.
    client
        A ``dask.distributed.Client`` for the analyses (default: threads).
    threads
        torch intra-op threads for training the arms; default: one for a model under
        20M parameters unless ``OMP_NUM_THREADS`` is set (:mod:`gradforensics.replay.threads`).
    **options
        Any field of the three groups by its name (``batch_size=16``, ``seq_len=64``,
        ``sketch=None``, ``loss="causal-lm"``, ``model_factory=...``, ...); it wins
        over the same field in *batches* / *record* / *model*.

    Returns
    -------
    WhatIf

    Raises
    ------
    SpecError, DataError, NotACheckpointError, CheckpointError, OfflineError
        Bad input, named on one line.
    WhatIfInterrupted
        Ctrl-C: the stores written so far are valid; the message says what they hold.
    TypeError
        A keyword in *options* that is no field of the three groups.
    """
    from gradforensics.replay.pipeline import data_sources

    text_field = options.get("text_field", _field(batches, "text_field", BatchSpec.text_field))
    sources = data_sources(data, text_field)
    names = [s.name for s in sources]
    arm_list = parse_arms(arms, mixtures, names)
    size = options.get("batch_size", _field(batches, "batch_size", BatchSpec.batch_size))
    if steps < 1 or size < 1:
        raise SpecError(f"--steps and --batch-size must be >= 1; got {steps} and {size}.")
    if steps > MAX_STEPS:
        raise SpecError(f"--steps {steps:,} is beyond {MAX_STEPS:,}: a what-if replays a short stretch of training "
                        "from the checkpoint, every step recorded.")
    b, r, m = _specs(batches, record, model, options)
    base = baseline or arm_list[0].name
    if base not in {a.name for a in arm_list}:
        raise SpecError(f"--baseline {base!r} is not an arm (arms: {', '.join(a.name for a in arm_list)}).")
    out_dir = Path(out)
    stores = _stores(out_dir, arm_list, store_suffix, overwrite)
    plans = {a.name: schedule(names, steps, a.mixture) for a in arm_list}
    say = log if log is not None else (sys.stderr if progress else None)
    with cleaned_on_failure(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
        setup = _Setup(checkpoint, b, r, m, threads, optimizer_state, overwrite, force)
        runs = _train(setup, arm_list, plans, stores, sources, say)
        return _analyse(out_dir, base, runs, only, client, progress, compare_reports)


@contextlib.contextmanager
def cleaned_on_failure(out_dir: Path) -> Iterator[None]:
    """On an error, remove what the block created in *out_dir* (the directory too, if it did not exist), and
    nothing else: the entries it held before stay.  Ctrl-C (``KeyboardInterrupt``, ``WhatIfInterrupted``) keeps
    everything: the stores of the steps done are valid, and the message says what they hold."""
    existed = out_dir.is_dir()
    before = {p.name for p in out_dir.iterdir()} if existed else set()
    try:
        yield
    except KeyboardInterrupt:
        raise
    except BaseException:
        with contextlib.suppress(OSError):        # the error that brought us here is the one to show
            if not existed:
                shutil.rmtree(out_dir)
            else:
                for p in out_dir.iterdir():
                    if p.name not in before:
                        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        raise


def _field(given: Any, name: str, default: Any) -> Any:
    """Field *name* of a spec or dict *given* (None: *default*), before the spec is built."""
    if isinstance(given, Mapping):
        return given.get(name, default)
    return default if given is None else getattr(given, name, default)


def _specs(batches: Any, record: Any, model: Any, options: Mapping[str, Any]) -> tuple[BatchSpec, RecordSpec,
                                                                                        ModelSpec]:
    """The three option groups, *options* (fields by name) over the groups given, over the defaults."""
    groups = (BatchSpec, RecordSpec, ModelSpec)
    known = {f.name: cls for cls in groups for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"whatif() got an unexpected keyword argument {unknown[0]!r}")
    over = {cls: {k: v for k, v in options.items() if known[k] is cls} for cls in groups}
    b = as_spec(BatchSpec, batches)
    r = as_spec(RecordSpec, record, defaults={"sketch": DEFAULT_SKETCH})
    m = as_spec(ModelSpec, model)
    return (dataclasses.replace(b, **over[BatchSpec]), dataclasses.replace(r, **over[RecordSpec]),
            dataclasses.replace(m, **over[ModelSpec]))


@dataclass(frozen=True)
class _Setup:
    """What every arm loads and records with."""

    checkpoint: str | os.PathLike[str]
    batches: BatchSpec
    record: RecordSpec
    model: ModelSpec
    threads: int | None
    state_file: Any
    overwrite: bool
    force: bool


def _train(setup: _Setup, arms: list[Arm], plans: dict[str, list[tuple[str, int]]], stores: dict[str, Path],
           sources: list[Any], say: IO[str] | None) -> list[ArmRun]:
    from gradforensics.replay import data as rdata
    from gradforensics.replay.pipeline import load_model, seq_len_for
    from gradforensics.replay.run import Progress, batch_size
    from gradforensics.replay.threads import for_model
    from gradforensics.runs.optim import find_state, read_state
    from gradforensics.runs.train import run_arm

    b, m = setup.batches, setup.model
    first = load_model(setup.checkpoint, m, b)
    seq_len, note = seq_len_for(b, first)
    if note and say is not None:
        print(note, file=say, flush=True)
    per_record = plan_record(first.model, setup.record, len(sources))
    names = [s.name for s in sources]
    _estimate(per_record, len(arms) * len(next(iter(plans.values()))), stores[arms[0].name], setup.force, say)
    batches = rdata.load_batches(sources, first.tokenizer, n_batches=_needs(plans, names), batch_size=b.batch_size,
                                 seq_len=seq_len, seed=b.seed, text_field=b.text_field)
    state_file = setup.state_file
    where = Path(state_file) if state_file not in (None, "none") else find_state(first.path)
    saved = read_state(where) if where is not None and state_file != "none" else None
    step0 = first.step if m.step is None else m.step
    recorder = dict(setup.record.recorder_options(), overwrite=setup.overwrite)
    runs: list[ArmRun] = []
    for i, arm in enumerate(arms):
        ckpt = first if i == 0 else load_model(setup.checkpoint, m, b)   # every arm starts from the checkpoint as saved

        def load(ckpt: Any = ckpt) -> tuple[Any, Any]:
            dev = m.device
            return ckpt.model, lambda net, batch: ckpt.loss_fn(net, {k: v.to(dev) for k, v in batch.items()})

        if say is not None:
            print(f"arm {arm.name}: {arm.describe()}", file=say, flush=True)
        bar = Progress(len(plans[arm.name]), say)
        done = [0]

        def tick(n: int, bar: Progress = bar, done: list[int] = done) -> None:
            done[0] = n
            bar.update(n)

        try:
            with for_model(ckpt.model, setup.threads):
                runs.append(run_arm(arm, load, batches, plans[arm.name], stores[arm.name], sources=names,
                                    step0=step0, seed=b.seed, saved_state=saved, state_where=str(where),
                                    recorder=recorder, count=batch_size, on_step=tick))
        except KeyboardInterrupt:
            bar.close()
            raise WhatIfInterrupted(_interrupted(runs, arm, done[0], stores)) from None
        bar.close()         # the arm's optimizer state is said once, in its summary line (WhatIf.runs[i].state_note)
    return runs


#: The refusal of a what-if the disk cannot hold (``{disk_of}``: the directory of the stores).
WHATIF_REFUSAL = ("the what-if stores need ~{total} but only {free} is free in {disk_of}; lower --sketch, record "
                  "fewer --tensors, fewer --steps or arms, or pass --force.")


def _estimate(per_record: dict[str, int], n_records: int, first: Path, force: bool, say: IO[str] | None) -> None:
    """Print the size of all the arms' stores; refuse (unless *force*) when the disk cannot hold them."""
    check_disk(per_record, n_records, first, force=force, say=say, label=" (all arms)", disk_of=first.parent,
               refusal=WHATIF_REFUSAL)


def _interrupted(runs: list[ArmRun], arm: Arm, n: int, stores: dict[str, Path]) -> str:
    done = "; ".join(f"{r.store} holds all {r.steps_done} steps" for r in runs)
    now = f"{stores[arm.name]} holds the {n} steps recorded before it" if n else f"arm {arm.name} recorded no step"
    return f"interrupted during arm {arm.name}; {done + '; ' if done else ''}{now}; no report was written."


def _analyse(out_dir: Path, base: str, runs: list[ArmRun], only: str | Sequence[str] | None,
             client: Client | None, progress: bool, compare_reports: bool) -> WhatIf:
    from gradforensics.analysis.engine.run import analyze
    from gradforensics.reporting.compare_render import write as write_compare
    from gradforensics.reporting.comparison import compare_findings
    from gradforensics.reporting.paths import under
    from gradforensics.runs.cosines import pair_table
    from gradforensics.runs.render import write

    findings = {r.arm.name: analyze(r.store, client=client, only=only, progress=progress) for r in runs}
    comparisons = {}
    for r in runs:
        if r.arm.name != base:
            comparisons[r.arm.name] = compare_findings(findings[base], findings[r.arm.name], (base, r.arm.name))
            if compare_reports:
                write_compare(comparisons[r.arm.name], under(out_dir, "compare", r.arm.name))
    result = WhatIf(out_dir, base, runs, findings, comparisons, pair_table(runs))
    result.paths = write(result, out_dir)
    return result
