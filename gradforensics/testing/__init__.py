"""Test helpers shipped with the package: contract suites and planted-truth store factories."""
