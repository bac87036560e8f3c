"""``gf.whatif(...)``: replay the problem checkpoint under several optimizers / mixtures, side by side.

The flow (design, "Comparing runs", ``whatif``):

1. check the data files and the arms (one-line errors, before the model loads);
2. load the checkpoint offline (:func:`gradforensics.replay.checkpoint.load_checkpoint`),
   pack each source's batches once, seeded (:func:`gradforensics.replay.data.load_batches`),
   print the size estimate of all the arms' stores and refuse when the disk is too small;
3. per arm: a fresh load, K steps on the shared batches, every step recorded
   (:func:`gradforensics.arms.train.run_arm`) into ``DIR/<arm>.zarr``;
4. analyse every store (:func:`gradforensics.analyze`), compare each arm with the
   baseline arm (:func:`gradforensics.report.comparison.compare_findings`, written
   as ``DIR/compare/<arm>/`` like ``gradforensics compare``), the arm-to-arm
   cosines per layer (:mod:`gradforensics.arms.cosines`), and write the
   what-if report (:mod:`gradforensics.arms.render`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import IO, TYPE_CHECKING, Any

from gradforensics.arms.spec import Arm, parse_arms, schedule
from gradforensics.errors import SpecError

if TYPE_CHECKING:
    import pandas as pd
    from dask.distributed import Client

    from gradforensics.analysis.engine.model import Findings
    from gradforensics.arms.train import ArmRun
    from gradforensics.report.comparison import Comparison

__all__ = ["DEFAULT_SKETCH", "WhatIf", "WhatIfInterrupted", "whatif"]

#: Sketch length per tensor (per head) recorded by default; ``sketch=None`` with ``full=None`` keeps whole tensors.
DEFAULT_SKETCH = 1024
#: A what-if longer than this many steps per arm is refused before anything is planned or allocated.
MAX_STEPS = 1_000_000


class WhatIfInterrupted(KeyboardInterrupt):
    """Ctrl-C during a what-if; ``str()`` says which stores hold which steps."""


@dataclass
class WhatIf:
    """What :func:`whatif` did: one run per arm, their findings, the comparisons with the baseline, the cosines."""

    out_dir: Path
    baseline: str
    runs: list[ArmRun]
    findings: dict[str, Findings]
    comparisons: dict[str, Comparison]
    cosines: pd.DataFrame
    paths: dict[str, Path] = field(default_factory=dict)

    def run(self, arm: str) -> ArmRun:
        return next(r for r in self.runs if r.arm.name == arm)

    def severity(self, arm: str, kind: str, tensor: str | None = None, sources: Sequence[str] | None = None) -> float:
        """The highest severity of *arm*'s flags of *kind* (on *tensor*, implicating all of *sources*); 0 if none."""
        flags = [f for f in self.findings[arm].flags if f.kind == kind and (tensor is None or f.tensor == tensor)
                 and set(sources or ()) <= set(f.sources)]
        return max((float(f.severity) for f in flags), default=0.0)


def _sources(data: Mapping[str, Any] | Sequence[str]) -> list[Any]:
    from gradforensics.replay import data as rdata

    specs = [f"{k}={v}" for k, v in data.items()] if isinstance(data, Mapping) else list(data)
    return rdata.parse_sources(specs)


def _stores(out: Path, arms: Sequence[Arm], suffix: str, overwrite: bool) -> dict[str, Path]:
    if suffix not in (".zarr", ".h5", ".hdf5"):
        raise SpecError(f"store_suffix must be .zarr, .h5 or .hdf5; got {suffix!r}.")
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
           batch_size: int = 8, seq_len: int = 512, seed: int = 0, text_field: str = "text",
           tensors: Sequence[str] | None = None, heads: Any = "auto", activations: Sequence[str] | None = None,
           sketch: int | None = DEFAULT_SKETCH, full: Sequence[str] | None = None, dtype: str | None = None,
           loss: str = "auto", model_factory: str | None = None, tokenizer: str | None = None,
           device: str = "cpu", model_dtype: str = "float32", step: int | None = None,
           optimizer_state: str | os.PathLike[str] | None = None, store_suffix: str = ".zarr",
           overwrite: bool = False, force: bool = False, compare_reports: bool = True,
           only: str | Sequence[str] | None = None, client: Client | None = None, progress: bool = True,
           log: IO[str] | None = None, threads: int | None = None) -> WhatIf:
    """Train *steps* steps from *checkpoint* once per arm on identical batches; record, analyse, compare.

    Parameters
    ----------
    checkpoint
        A Hugging Face model directory, or a state-dict file with *model_factory*
        (and *tokenizer*), as for ``gradforensics capture``.
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
        20M parameters unless ``OMP_NUM_THREADS`` is set (:mod:`gradforensics._threads`).
    Other parameters
        As for ``gradforensics capture`` (*sketch* defaults to 1024 here).

    Returns
    -------
    WhatIf

    Raises
    ------
    SpecError, DataError, NotACheckpointError, CheckpointError, OfflineError
        Bad input, named on one line.
    WhatIfInterrupted
        Ctrl-C: the stores written so far are valid; the message says what they hold.
    """
    from gradforensics.replay import data as rdata

    sources = _sources(data)
    for src in sources:
        rdata.precheck(src, text_field)
    names = [s.name for s in sources]
    arm_list = parse_arms(arms, mixtures, names)
    if steps < 1 or batch_size < 1:
        raise SpecError(f"--steps and --batch-size must be >= 1; got {steps} and {batch_size}.")
    if steps > MAX_STEPS:
        raise SpecError(f"--steps {steps:,} is beyond {MAX_STEPS:,}: a what-if replays a short stretch of training "
                        "from the checkpoint, every step recorded.")
    if sketch is not None and sketch < 1:
        raise SpecError(f"--sketch must be >= 1; got {sketch}.")
    base = baseline or arm_list[0].name
    if base not in {a.name for a in arm_list}:
        raise SpecError(f"--baseline {base!r} is not an arm (arms: {', '.join(a.name for a in arm_list)}).")
    out_dir = Path(out)
    stores = _stores(out_dir, arm_list, store_suffix, overwrite)
    plans = {a.name: schedule(names, steps, a.mixture) for a in arm_list}
    say = log if log is not None else (sys.stderr if progress else None)
    setup = SimpleNamespace(checkpoint=checkpoint, loss=loss, model_factory=model_factory, tokenizer=tokenizer,
                            device=device, model_dtype=model_dtype, seed=seed, tensors=tensors, full=full,
                            activations=activations, sketch=sketch, data=[s.name for s in sources],
                            threads=threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = _train(setup, arm_list, plans, stores, sources, heads, dtype, step, optimizer_state,
                  dict(batch_size=batch_size, seq_len=seq_len, seed=seed, text_field=text_field), overwrite, force,
                  say)
    return _analyse(out_dir, base, runs, only, client, progress, compare_reports)


def _load(setup: Any) -> Any:
    from gradforensics.replay.checkpoint import load_checkpoint, offline

    with offline():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        return load_checkpoint(setup.checkpoint, loss=setup.loss, model_factory=setup.model_factory,
                               tokenizer=setup.tokenizer, device=setup.device, model_dtype=setup.model_dtype,
                               seed=setup.seed)


def _train(setup: Any, arms: list[Arm], plans: dict[str, list[tuple[str, int]]], stores: dict[str, Path],
           sources: list[Any], heads: Any, dtype: str | None, step: int | None, state_file: Any,
           batching: dict[str, Any], overwrite: bool, force: bool, say: IO[str] | None) -> list[ArmRun]:
    from gradforensics._threads import for_model
    from gradforensics.arms.optim import find_state, read_state
    from gradforensics.arms.train import run_arm
    from gradforensics.commands.capture import check_seq_len, plan_record_bytes
    from gradforensics.replay import data as rdata
    from gradforensics.replay.checkpoint import max_positions
    from gradforensics.replay.run import Progress, batch_size

    first = _load(setup)
    check_seq_len(batching["seq_len"], first.max_positions, max_positions(first.model)[1])
    per_record = plan_record_bytes(setup, first.model, heads, dtype)
    names = [s.name for s in sources]
    _estimate(per_record, len(arms) * len(next(iter(plans.values()))), stores[arms[0].name], force, say)
    batches = rdata.load_batches(sources, first.tokenizer, n_batches=_needs(plans, names), **batching)
    where = Path(state_file) if state_file not in (None, "none") else find_state(first.path)
    saved = read_state(where) if where is not None and state_file != "none" else None
    step0 = first.step if step is None else step
    recorder = dict(tensors=setup.tensors, heads=heads, activations=setup.activations, sketch=setup.sketch,
                    full=setup.full, dtype=dtype, overwrite=overwrite)
    runs: list[ArmRun] = []
    for i, arm in enumerate(arms):
        ckpt = first if i == 0 else _load(setup)      # every arm starts from the checkpoint as saved

        def load(ckpt: Any = ckpt) -> tuple[Any, Any]:
            dev = setup.device
            return ckpt.model, lambda m, b: ckpt.loss_fn(m, {k: v.to(dev) for k, v in b.items()})

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
                                    step0=step0, seed=setup.seed, saved_state=saved, state_where=str(where),
                                    recorder=recorder, count=batch_size, on_step=tick))
        except KeyboardInterrupt:
            bar.close()
            raise WhatIfInterrupted(_interrupted(runs, arm, done[0], stores)) from None
        bar.close()
        if say is not None:
            print(f"  {runs[-1].state_note}", file=say, flush=True)
    return runs


def _estimate(per_record: dict[str, int], n_records: int, first: Path, force: bool, say: IO[str] | None) -> None:
    """Print the size of all the arms' stores; refuse (unless *force*) when the disk cannot hold them."""
    from gradforensics._format import fmt_bytes
    from gradforensics.replay.run import size_estimate

    est = size_estimate(per_record["total"], n_records, first)
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in per_record.items() if k != "total" and v)
    if say is not None:
        print(f"estimate: {n_records} records (all arms) x {fmt_bytes(est['bytes_per_record'])} ({parts}) = "
              f"{fmt_bytes(est['total_bytes'])}; {fmt_bytes(est['free_bytes'])} free on the disk of {first.parent}.",
              file=say, flush=True)
    if est["total_bytes"] > est["free_bytes"] and not force:
        raise SpecError(f"the what-if stores need ~{fmt_bytes(est['total_bytes'])} but only "
                        f"{fmt_bytes(est['free_bytes'])} is free in {first.parent}; lower --sketch, record fewer "
                        "--tensors, fewer --steps or arms, or pass --force.")


def _interrupted(runs: list[ArmRun], arm: Arm, n: int, stores: dict[str, Path]) -> str:
    done = "; ".join(f"{r.store} holds all {r.steps_done} steps" for r in runs)
    now = f"{stores[arm.name]} holds the {n} steps recorded before it" if n else f"arm {arm.name} recorded no step"
    return f"interrupted during arm {arm.name}; {done + '; ' if done else ''}{now}; no report was written."


def _analyse(out_dir: Path, base: str, runs: list[ArmRun], only: str | Sequence[str] | None,
             client: Client | None, progress: bool, compare_reports: bool) -> WhatIf:
    from gradforensics.analysis.engine import analyze
    from gradforensics.arms.cosines import pair_table
    from gradforensics.arms.render import write
    from gradforensics.report.compare_render import write as write_compare
    from gradforensics.report.comparison import compare_findings
    from gradforensics.report.paths import under

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
