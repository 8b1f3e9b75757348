"""Example pdcluster KV connector plugin: KV blocks handed over through files in a directory."""

from __future__ import annotations

from .connector import FileConnector

__all__ = ["FileConnector"]
