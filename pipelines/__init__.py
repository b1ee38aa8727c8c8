"""Concrete precache pipelines and training entry points; thin compositions of the library.

``precache`` never imports this package; ``precache run NAME`` finds pipelines through the
``precache.pipelines`` entry points declared in pyproject.toml.
"""
