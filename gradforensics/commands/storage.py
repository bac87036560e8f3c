"""``--storage-option KEY=VALUE`` (repeatable): storage options of the stores a command names by URL.

The options are parsed once (:func:`gradforensics.store.remote.parse_options`:
``VALUE`` as JSON where it parses, dotted keys nest) and registered for every
store URL on the command line, so each open of those URLs in this process - and
each dask task, which carries them - uses them.  Credentials are better left to
the environment (``AWS_ACCESS_KEY_ID``, ...): options given here travel to the
dask workers inside the task graph.
"""

from __future__ import annotations

import argparse

from gradforensics.store import remote


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="for a store at an fsspec URL (s3://bucket/dump.zarr): an option of its file system, e.g. "
                        "endpoint_url=http://127.0.0.1:9000 or anon=true (repeatable; credentials and endpoints "
                        "also come from the environment: AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...)")


def register(args: argparse.Namespace, *paths: str) -> None:
    """Register the ``--storage-option`` flags for each of *paths* that is a URL."""
    options = remote.parse_options(getattr(args, "storage_option", None))
    for path in paths:
        if remote.is_url(path):
            remote.register(path, options)
