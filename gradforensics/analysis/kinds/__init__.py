"""The analyses, one module each; each exposes ``ANALYSIS`` (see :mod:`gradforensics.analysis`)."""

__all__: list[str] = []

