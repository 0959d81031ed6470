"""Kept for tools that still call `python setup.py`; the metadata lives in pyproject.toml."""

from setuptools import setup

setup()
