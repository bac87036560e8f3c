"""The package version, in a module of its own so any module can read it without importing the package's API."""

__all__: list[str] = []


__version__ = "0.1.0"
