"""Optional dependencies: one line naming the extra when one is missing, never a traceback.

``torch`` (capture, the demo), ``transformers`` (the ``hf`` extra: the demo, Hugging Face
checkpoints) and ``distributed`` (``--workers``/``--scheduler``) are extras in
``pyproject.toml``.  A command checks for what it needs before it starts, without
importing it (``importlib.util.find_spec``), so the check costs nothing and an import
that must happen later under special settings (``HF_HUB_OFFLINE``) still happens there.
"""

from __future__ import annotations

import importlib.util

from gradforensics.errors import MissingExtraError

__all__ = ["EXTRAS", "require_extra"]


#: module -> the extra of ``gradforensics`` that installs it.
EXTRAS = {"torch": "torch", "transformers": "hf", "distributed": "distributed", "tensorboard": "logs"}


def require_extra(module: str, what: str) -> None:
    """Raise :class:`MissingExtraError` (one line, naming the extra) when *module* cannot be imported.

    Parameters
    ----------
    module
        Top-level module name, a key of :data:`EXTRAS`.
    what
        Who needs it, as the message says it: ``"the demo"``, ``"--workers"``.
    """
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):        # a broken or blocked (sys.modules[name] = None) package
        found = False
    if not found:
        extra = EXTRAS[module]
        raise MissingExtraError(f"{what} needs the '{extra}' extra ({module} is not installed): "
                                f"pip install 'gradforensics[{extra}]'")
