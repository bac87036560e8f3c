"""``gradforensics capture CHECKPOINT --data NAME=FILE ... --out STORE``: dump a problem checkpoint.

A thin wrapper of :func:`gradforensics.replay.pipeline.capture_checkpoint` (``gf.capture``):
the flags become the three option groups of :mod:`gradforensics.replay.plan`
(:func:`specs`), and under ``torchrun`` this process joins the process group
first (:func:`launch`).  The library loads the checkpoint offline, packs each
source's text into seeded batches, prints a size estimate and refuses when the
disk cannot hold it (unless ``--force``), then replays the batches through the
model with a progress bar.  ``Ctrl-C`` stops it and leaves a valid store with
the records written so far (exit 130).  See ``docs/capture-your-checkpoint.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING, Any

from gradforensics.errors import SpecError
from gradforensics.replay.plan import DTYPE_NAMES, BatchSpec, ModelSpec, RecordSpec

if TYPE_CHECKING:
    from gradforensics.replay.distributed import Launch

__all__ = ["add_arguments", "add_curvature_options", "add_model_options", "curvature_of", "flags_of", "launch", "run",
           "specs"]



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a Hugging Face model directory, or a state-dict file with --model-factory")
    p.add_argument("--data", action="append", required=True, metavar="NAME=FILE",
                   help="a data source: .txt (one document a line) or .jsonl; repeat for each source")
    from gradforensics.commands import output
    from gradforensics.commands import storage as storage_flags

    output.add_out(p, "the store to write: *.zarr or *.h5, or a Zarr store at an fsspec URL (s3://bucket/dump.zarr)",
                   kind="store")
    storage_flags.add_argument(p)
    g = p.add_argument_group("batches")
    g.add_argument("--batches-per-source", type=int, default=64, metavar="N", help="batches replayed per source")
    g.add_argument("--batch-size", type=int, default=8, metavar="B", help="sequences per batch")
    g.add_argument("--seq-len", type=int, default=None, metavar="T",
                   help="tokens per sequence (packed; default 512, or the model's own limit when lower)")
    g.add_argument("--text-field", default="text", help="the document field of .jsonl lines (default text)")
    g.add_argument("--seed", type=int, default=0, help="seed of the batch draw and of masked-LM masking")
    r = p.add_argument_group("what to record")
    r.add_argument("--tensors", nargs="+", metavar="GLOB", help="parameter globs (default: every 2-D weight)")
    r.add_argument("--heads", nargs="+", default=["auto"], metavar="SPEC",
                   help="auto (default), none, FILE.json, or GLOB=H[:axis=A,fused=F,role=R] / GLOB=none entries "
                        "(F: qkv, kv or q8k2v2 for grouped-query; add auto to keep the rules for the rest)")
    r.add_argument("--activations", nargs="+", metavar="GLOB", help="module globs: per-unit activation statistics")
    r.add_argument("--attention", nargs="*", metavar="GLOB",
                   help="per-head attention logits and entropy (no GLOB: every attention module); runs eager attention")
    r.add_argument("--logits", nargs="*", metavar="GLOB",
                   help="log Z and logit statistics of the output logits (no GLOB: the output embedding)")
    r.add_argument("--experts", nargs="*", metavar="GLOB=E",
                   help="mixture-of-experts: per-expert gradient units and router load, entropy and z "
                        "(no entry: every module named experts; GLOB=E: experts modules and their count)")
    r.add_argument("--sketch", type=int, metavar="K", help="store a K-dim sketch per tensor (per head)")
    r.add_argument("--full", nargs="+", metavar="GLOB",
                   help="with --sketch: tensors whose whole gradient is stored too (default none)")
    r.add_argument("--dtype", choices=sorted(DTYPE_NAMES), help="on-disk gradient format (default: as computed)")
    add_model_options(p)
    add_curvature_options(p)
    p.add_argument("--check-ranks", action="store_true",
                   help="under torchrun: replay the same batches on every rank (whole model each) to find a rank "
                        "that computes a different gradient (the rankconsistency analysis)")
    p.add_argument("--force", action="store_true", help="go on even if the estimate exceeds the free disk")
    output.add_overwrite(p, "the store")
    output.add_quiet(p)


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The "model" options ``capture`` and ``whatif`` share: loss, raw-checkpoint factory, tokenizer, device."""
    m = p.add_argument_group("model")
    m.add_argument("--loss", default="auto",
                   help="auto (from the config), causal-lm, masked-lm, or module:function taking (model, batch)")
    m.add_argument("--model-factory", metavar="MODULE:FUNCTION",
                   help="builds the nn.Module of a raw PyTorch checkpoint (loaded with weights_only=True)")
    m.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (default: the checkpoint directory)")
    m.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    m.add_argument("--model-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="the dtype the model runs in")
    m.add_argument("--step", type=int, help="optimizer step of the checkpoint (default: trainer_state.json, else 0)")
    from gradforensics.commands import threads

    threads.add_argument(m)


def add_curvature_options(p: argparse.ArgumentParser) -> None:
    """``--curvature`` and its options (``docs/curvature.md``): Hessian eigenvalues and the optimizer state."""
    c = p.add_argument_group("curvature and optimizer state")
    c.add_argument("--curvature", action="store_true",
                   help="also store the top Hessian eigenvalues (whole model, each block; Lanczos) and the "
                        "checkpoint's optimizer state summaries (curvature/, optim/)")
    c.add_argument("--curvature-blocks", dest="blocks", choices=("tensor", "layer"), default="tensor",
                   help="a block is a tensor (default) or a layer's tensors")
    c.add_argument("--curvature-tensors", dest="curvature_tensors", nargs="+", metavar="GLOB",
                   help="parameters that get blocks of their own (default every trainable one; the whole model "
                        "always counts all)")
    c.add_argument("--curvature-k", dest="k", type=int, default=3, metavar="K", help="top eigenvalues (default 3)")
    c.add_argument("--curvature-iters", dest="max_iter", type=int, default=40, metavar="M",
                   help="Lanczos iterations at most, per block and source (default 40)")
    c.add_argument("--curvature-batches", dest="batches", type=int, default=2, metavar="N",
                   help="replayed batches per source the Hessian is taken on (default 2)")
    c.add_argument("--optimizer", choices=("adam", "sgd", "sgd-momentum"),
                   help="the optimizer (default: read from the checkpoint's optimizer state)")
    for name in ("lr", "momentum", "beta1", "beta2", "eps"):
        c.add_argument(f"--{name}", type=float, help=f"the optimizer's {name} (default: from the checkpoint)")


# ------------------------------------------------------------------ flags -> specs
def flags_of(args: argparse.Namespace, group: type[Any]) -> dict[str, Any]:
    """The flags of *args* that are fields of the option group *group* (a spec class of :mod:`gradforensics.replay.plan`).

    The flags' destinations are the fields' names (``--batch-size`` -> ``batch_size``);
    a field the command has no flag for keeps the group's default.
    """
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(group) if hasattr(args, f.name)}


def specs(args: argparse.Namespace) -> tuple[BatchSpec, RecordSpec, ModelSpec]:
    """``capture``'s flags as the three option groups (one-line :class:`SpecError` on a bad value)."""
    return (BatchSpec(**flags_of(args, BatchSpec)), RecordSpec(**flags_of(args, RecordSpec)),
            ModelSpec(**flags_of(args, ModelSpec)))


# ------------------------------------------------------------------ run
def run(args: argparse.Namespace) -> int:
    from gradforensics._extras import require_extra

    require_extra("torch", "gradforensics capture")
    require_extra("transformers", "gradforensics capture")
    from gradforensics.commands import output
    from gradforensics.errors import CaptureInterrupted, HeadSplitError
    from gradforensics.replay.pipeline import capture_checkpoint

    batches, record, model = specs(args)
    output.check_store(args.out, args.overwrite)
    ranks = launch(args.device, args.check_ranks)
    if ranks is not None:
        model = dataclasses.replace(model, device=ranks.device)
    from gradforensics.commands import storage as storage_flags
    from gradforensics.store.remote import is_url

    # a local --out is checked by the library first (its suffix, in the command's words)
    options = storage_flags.location(args, args.out).storage_options if is_url(args.out) else None
    try:
        done = capture_checkpoint(args.checkpoint, args.data, args.out, batches=batches, record=record, model=model,
                                  storage_options=options,
                                  overwrite=args.overwrite, force=args.force,
                                  quiet=args.quiet or bool(ranks is not None and ranks.rank),   # rank 0 speaks
                                  threads=args.threads, launch=ranks, check_ranks=args.check_ranks,
                                  curvature=curvature_of(args))
    except CaptureInterrupted as exc:
        print(f"gradforensics capture: {exc}", file=sys.stderr)
        return 130
    except HeadSplitError as exc:           # the fix in the command's words (--heads), not Python's
        raise SpecError(exc.cli) from None
    finally:
        if ranks is not None:
            from gradforensics.replay import distributed

            distributed.finish()
    if ranks is not None and ranks.rank:
        return 0
    out = done.out
    print(f"{out}: {done.store.n_records} records of {len(done.sources)} sources ({', '.join(done.sources)}), "
          f"loss {done.loss_name}; next: gradforensics analyze {out} --out REPORT_DIR", file=sys.stderr)
    return 0


def curvature_of(args: argparse.Namespace) -> Any:
    """The ``curvature=`` of ``gf.capture`` the flags ask for (None without ``--curvature``)."""
    from gradforensics.replay.probe import CurvatureSpec

    if not getattr(args, "curvature", False):
        return None
    return CurvatureSpec(**{**flags_of(args, CurvatureSpec), "tensors": args.curvature_tensors})


def launch(device: str, check_ranks: bool) -> Launch | None:
    """Under torchrun: join the process group; ``None`` in a single process."""
    from gradforensics.replay import distributed

    ranks = distributed.from_env(device)
    if ranks is None:
        if check_ranks:
            raise SpecError("--check-ranks compares ranks: start the command with torchrun --nproc-per-node R.")
        return None
    distributed.init(ranks)
    return ranks
