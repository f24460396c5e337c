"""Mirrors of ``opacus.utils`` modules, so that Opacus code runs with only the import changed."""
