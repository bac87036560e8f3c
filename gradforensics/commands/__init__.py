"""One module per CLI verb (see gradforensics.cli)."""

__all__: list[str] = []

