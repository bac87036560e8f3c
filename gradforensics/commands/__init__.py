"""One module per CLI verb (see gradforensics.cli)."""
