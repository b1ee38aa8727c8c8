"""Concrete precache pipelines and training entry points; thin compositions of the library.

Installed as ``precache.pipelines`` (this folder is mapped there in pyproject.toml), so a
project's own ``pipelines`` package never meets ours. The library never imports this package;
``precache run NAME`` finds pipelines through the ``precache.pipelines`` entry points.
"""
