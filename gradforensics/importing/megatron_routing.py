"""Megatron-LM's ``tokens_per_expert/`` log (``--save-tokens-per-expert-interval N``) as router loads.

The log, as NVIDIA/Megatron-LM writes it (commit ``d98e8a64``, August 2026:
``megatron/training/activation_logging.py`` ``ActivationLogger.save_tpe``, called from ``train_step``
in ``megatron/training/training.py`` with ``iteration + 1`` when ``(iteration + 1) %
save_tokens_per_expert_interval == 0``)::

    <save>/tokens_per_expert/rank<global rank>.jsonl

one JSON object per line, appended by every rank whose model chunk has grouped experts
(``TEGroupedLinear``: the hook reads its ``m_splits``, so ``SequentialMLP`` experts log nothing)::

    {"iter": 100, "block": "decoder", "layer": 3, "tpe": [[128, 64], [96, 80]]}
    {"iter": 100, "block": "mtp", "mtp_idx": 0, "layer": 1, "tpe": [[50, 50]]}

``tpe``: per micro-batch of the iteration, the tokens routed to each of the rank's local experts;
``layer`` is the layer number inside the rank's model chunk.

What the import makes of it: per record and router (``decoder.layers.<layer>.mlp.router``, MTP's
``mtp.layers.<i>.mtp_model_layer.layers.<layer>.mlp.router``), ``router/<router>/load`` ``(N, E)``: each
expert's share of the tokens routed over every micro-batch and rank of the iteration (local expert
``j`` of the rank with expert-parallel rank ``(rank // etp) % ep`` - Megatron-LM's expert rank order
``tp-ep-dp-pp`` - is expert ``ep_rank * num_local + j``), and ``max_share``.  A token is counted
once per expert tensor-parallel rank and data-parallel replica that saw it: every expert alike, so
the shares are the run's.  ``entropy`` and ``logit_z`` need the router's logits, which the log does
not hold: NaN.  ``top_k`` (the ``load`` attribute) is the run's ``--moe-router-topk``, given.

**Pipeline parallelism**: ``layer`` is stage-local (each rank's chunk numbers its layers from 0).  With the
layout (``pp``) and the dump's own stages (:func:`gradforensics.importing.megatron.stage_layers`: each stage's
first global layer and its stage-local layers with experts), rank ``R`` is on pipeline stage ``R // (W / pp)``
(``pp`` the outermost of Megatron-LM's rank order ``tp-cp-ep-dp-pp``; ``W`` the world size, ``max R + 1``: the
last stage's ranks log when it has expert layers) and its ``layer`` becomes ``first layer of the stage + layer``.
Checked: every logged layer is an expert layer of that rank's stage, and every rank of a stage with expert
layers logged.  ``--use-tp-pp-dp-mapping`` (order ``tp-cp-ep-pp-dp``, ``megatron/training/initialize.py``) is
not this placement and cannot be told from the log.

Refused in one line: a malformed line, a layer whose ranks log different numbers of local experts.
Not read (the import says why, in ``extra["import"]["router"]``): virtual pipeline stages (``vp > 1``: each
chunk numbers its layers from 0 and the log keys counts by that number alone, mixing the chunks), pipeline
parallelism without the dump's stages, or when the ranks do not fit them (above), several ranks without
``--layout`` (their expert ranks), a log without every record's iteration.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import CheckpointError, LogNotPlacedError, SpecError
from gradforensics.store.names import check_name
from gradforensics.store.schema import router_path
from gradforensics.store.writer import Row

if TYPE_CHECKING:
    from gradforensics.importing.megatron import Layout

__all__ = ["MAX_LINE", "RouterLoads", "joined_routing", "read_tokens_per_expert"]

#: the longest line read (bytes): a line is one layer's counts of one iteration
MAX_LINE = 1 << 22
_RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")


def _router(obj: Mapping[str, Any], where: str, stage: tuple[int, frozenset[int]] | None = None,
            pp_rank: int = 0) -> str:
    block, layer = obj.get("block"), obj.get("layer")
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
        raise CheckpointError(f"{where}: 'layer' must be an integer >= 0; got {layer!r}.")
    if block == "decoder":
        if stage is not None:           # stage-local under pipeline parallelism: the stage's first layer added
            first, moe = stage
            if layer not in moe:
                raise LogNotPlacedError(f"{where} logs layer {layer} of pipeline stage {pp_rank}, which has no "
                                        f"experts in the dump (its expert layers: {sorted(moe)}); the ranks do not "
                                        "fit the stages")
            layer += first
        return check_name(f"decoder.layers.{layer}.mlp.router", "router module")
    mtp = obj.get("mtp_idx")
    if block == "mtp" and isinstance(mtp, int) and not isinstance(mtp, bool) and mtp >= 0:
        return check_name(f"mtp.layers.{mtp}.mtp_model_layer.layers.{layer}.mlp.router", "router module")
    raise CheckpointError(f"{where}: 'block' must be 'decoder' or 'mtp' (with an integer mtp_idx); got {block!r}.")


def _stage_of(files: Mapping[int, Path], pp: int,
              stages: Mapping[int, tuple[int, frozenset[int]]]) -> dict[int, int]:
    """``{rank: pipeline rank}``: stage ``R // (W / pp)``, ``W = max R + 1`` (the last stage must log); every rank
    of a stage with expert layers must have logged (:class:`~gradforensics.errors.LogNotPlacedError` otherwise)."""
    if not stages.get(pp - 1, (0, frozenset()))[1]:
        raise LogNotPlacedError("the last pipeline stage has no expert layer in the dump, so its ranks log "
                                f"nothing and the ranks per stage cannot be told from rank{max(files)}.jsonl")
    world = max(files) + 1
    if world % pp:
        raise LogNotPlacedError(f"ranks 0..{world - 1} logged: not {pp} pipeline stages of equal size")
    per = world // pp
    for p in range(pp):
        if stages.get(p, (0, frozenset()))[1]:
            lost = [r for r in range(p * per, (p + 1) * per) if r not in files]
            if lost:
                raise LogNotPlacedError(f"rank{lost[0]}.jsonl is missing: pipeline stage {p} (ranks {p * per}.."
                                        f"{(p + 1) * per - 1}) has expert layers and every one of its ranks logs")
    return {r: r // per for r in files}


def read_tokens_per_expert(d: Path, layout: Layout | None,
                           stages: Mapping[int, tuple[int, frozenset[int]]] | None = None
                           ) -> dict[int, dict[str, np.ndarray]]:
    """``{iteration: {router module: tokens per global expert (float64)}}`` of every ``rank<R>.jsonl`` in *d*.

    Under pipeline parallelism *stages* (:func:`gradforensics.importing.megatron.stage_layers`) maps each rank's
    stage-local layers to global ones; :class:`~gradforensics.errors.LogNotPlacedError` when the ranks do not fit them.
    """
    from gradforensics.replay.untrusted import open_regular

    files = {int(m.group(1)): p for p in sorted(d.iterdir()) if (m := _RANK_FILE.match(p.name))}
    if not files:
        raise CheckpointError(f"{d}: no rank<R>.jsonl file (Megatron-LM's --save-tokens-per-expert-interval log).")
    ep, etp = (layout.ep, layout.etp_size) if layout is not None else (1, 1)
    pp = layout.pp if layout is not None else 1
    stage_of = _stage_of(files, pp, stages) if pp > 1 and stages is not None else None
    out: dict[int, dict[str, np.ndarray]] = {}
    local: dict[str, int] = {}
    for rank, path in files.items():
        ep_rank = (rank // etp) % ep
        p = stage_of[rank] if stage_of is not None else 0
        stage = stages.get(p, (0, frozenset())) if stage_of is not None and stages is not None else None
        with open_regular(path) as fh:
            for i, raw in enumerate(iter(lambda: fh.readline(MAX_LINE + 1), b""), 1):
                where = f"{path}:{i}"
                if len(raw) > MAX_LINE:
                    raise CheckpointError(f"{where}: a line longer than {MAX_LINE} B; not Megatron-LM's log.")
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except (ValueError, UnicodeDecodeError) as exc:
                    raise CheckpointError(f"{where}: not a JSON object ({str(exc)[:80]}).") from exc
                if not isinstance(obj, dict):
                    raise CheckpointError(f"{where}: not a JSON object.")
                it, tpe = obj.get("iter"), obj.get("tpe")
                if not isinstance(it, int) or isinstance(it, bool) or it < 0:
                    raise CheckpointError(f"{where}: 'iter' must be an integer >= 0; got {it!r}.")
                rows = tpe if isinstance(tpe, list) and tpe else None
                n = len(rows[0]) if rows and isinstance(rows[0], list) else 0
                if not rows or not n or not all(isinstance(r, list) and len(r) == n and all(
                        isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in r) for r in rows):
                    raise CheckpointError(f"{where}: 'tpe' must be a list of micro-batches, each the same number "
                                          "of token counts (integers >= 0) per local expert.")
                router = _router(obj, where, stage, p)
                if local.setdefault(router, n) != n:
                    raise CheckpointError(f"{where}: {router} has {n} local experts here, {local[router]} on another "
                                          "rank; every expert rank holds as many.")
                counts = out.setdefault(it, {}).setdefault(router, np.zeros(ep * n, np.float64))
                counts[ep_rank * n: (ep_rank + 1) * n] += np.asarray(rows, np.float64).sum(axis=0)
    return out


class RouterLoads:
    """Called with a record's iteration: its ``router/<module>/{load, max_share, entropy, logit_z}`` rows."""

    def __init__(self, counts: Mapping[int, Mapping[str, np.ndarray]], top_k: int, note: str) -> None:
        self.counts, self.top_k, self.note = counts, top_k, note
        self.routers = sorted({r for per in counts.values() for r in per})

    def __call__(self, it: int) -> dict[str, Row]:
        out: dict[str, Row] = {}
        per = self.counts.get(it, {})
        for router in self.routers:
            c = per.get(router)
            if c is None:
                raise CheckpointError(f"tokens_per_expert: no line for {router} at iteration {it}; every logged "
                                      "iteration has every router.")
            total = c.sum()
            load = (c / total if total > 0 else np.full(c.size, np.nan)).astype(np.float32)
            out[router_path(router, "load")] = Row(load, {"experts": int(c.size), "top_k": self.top_k})
            out[router_path(router, "max_share")] = Row(np.asarray(np.nanmax(load) if total > 0 else np.nan,
                                                                   np.float32))
            out[router_path(router, "entropy")] = Row(np.asarray(np.nan, np.float32))
            out[router_path(router, "logit_z")] = Row(np.asarray(np.nan, np.float32))
        return out


#: ``extra["import"]["router"]`` of a store that holds router loads from the log
JOINED = ("load and max_share from tokens_per_expert/ (tokens routed per expert, every micro-batch and rank); "
          "entropy and logit_z are not in the log: NaN")


def joined_routing(source: Path, layout: Layout | None, steps: Sequence[int], top_k: int | None, *,
                   quiet: bool = True, stages: Mapping[int, tuple[int, frozenset[int]]] | None = None,
                   tp_pp_dp: bool | None = None) -> RouterLoads | str | None:
    """The router loads of the records at iterations *steps* from ``<source>/tokens_per_expert/``: None when there
    is no such log, else a :class:`RouterLoads`, or the sentence saying why it is not read (also on stderr unless
    *quiet*).  *stages*: the dump's pipeline stages (:func:`gradforensics.importing.megatron.stage_layers`), which
    place a pipeline-parallel run's stage-local layer numbers; *tp_pp_dp*: the run's saved
    ``use_tp_pp_dp_mapping`` (None: no saved arguments, the default rank order assumed and said so)."""
    d = source / "tokens_per_expert"
    if not d.is_dir():
        return None
    why = None
    ranks = [p for p in d.iterdir() if _RANK_FILE.match(p.name)]
    if layout is not None and layout.vp > 1:
        why = (f"not read: with virtual pipeline stages (vp={layout.vp}) each model chunk numbers its layers from 0 "
               "and the log keys the counts by that number alone, mixing the chunks")
    elif layout is not None and layout.pp > 1 and tp_pp_dp:
        why = ("not read: the run used --use-tp-pp-dp-mapping (rank order tp-cp-ep-pp-dp), whose pipeline stages "
               "this import does not place")
    elif layout is not None and layout.pp > 1 and not stages:
        why = ("not read: under pipeline parallelism its layer numbers are per stage and the dump's stages are "
               "not known")
    elif layout is None and len(ranks) > 1:
        why = "not read: several ranks logged it; give --layout (ep=, etp=) to number their experts"
    elif top_k is None:
        why = ("not read: give the run's --moe-router-topk as --moe-topk K (the load's ceiling 1/k), or the run's "
               "saved arguments that hold it (--args-from)")
    else:
        try:
            counts = read_tokens_per_expert(d, layout, stages)
        except LogNotPlacedError as exc:
            counts, why = {}, f"not read: {exc}"
        lost = [s for s in steps if s not in counts]
        if why is None and lost:
            why = (f"not read: it has no iteration {lost[0]} (logged at {', '.join(map(str, sorted(counts)[:4]))}"
                   f"{', ...' if len(counts) > 4 else ''}); every record needs one")
        elif why is None:
            k = top_k
            e = min(int(c.size) for per in counts.values() for c in per.values())
            if not 1 <= k <= e:
                raise SpecError(f"--moe-topk {k}: must be between 1 and the experts of a layer ({e}).")
            if layout is not None and layout.pp > 1 and tp_pp_dp is None:
                assumed = ("; ranks placed on pipeline stages in Megatron-LM's default rank order tp-cp-ep-dp-pp, "
                           "unchecked: no saved arguments say whether the run used --use-tp-pp-dp-mapping")
                if not quiet:
                    print(f"import: tokens_per_expert/{assumed[1:]}.", file=sys.stderr)
                return RouterLoads(counts, k, JOINED + assumed)
            return RouterLoads(counts, k, JOINED)
    if not quiet:
        print(f"import: tokens_per_expert/ {why}.", file=sys.stderr)
    return f"tokens_per_expert/ {why}"
