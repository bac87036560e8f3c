"""``--storage-option KEY=VALUE`` (repeatable): storage options of the stores a command names by URL.

The options are parsed once (:func:`gradforensics.store.remote.parse_options`:
``VALUE`` as JSON where it parses, dotted keys nest) and go into the
:class:`~gradforensics.store.location.Location` of each store URL on the command
line (:func:`location`); everything that opens that store - reads, the lock,
results written back, each dask task - carries them from there.  Credentials are
better left to the environment (``AWS_ACCESS_KEY_ID``, ...): options given here
travel to the dask workers inside the task graph.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gradforensics.store.location import Location

__all__ = ["add_argument", "location"]


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="for a store at an fsspec URL (s3://bucket/dump.zarr): an option of its file system, e.g. "
                        "endpoint_url=http://127.0.0.1:9000 or anon=true (repeatable; credentials and endpoints "
                        "also come from the environment: AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...)")


def location(args: argparse.Namespace, path: str) -> Location:
    """The store *path* of the command line, with the ``--storage-option`` flags when it is a URL."""
    from gradforensics.store import remote
    from gradforensics.store.backends import locate

    options = remote.parse_options(getattr(args, "storage_option", None))
    return locate(path, options if remote.is_url(path) else None)
