"""The course's apparatus, apart from the runtime, and its printed words in the reader's language.

Its parts: ``upstream`` (llama-server's C++ read by name, the MAP, the llama-server build), ``bench``
(``llmkit bench``), ``launch`` (servers in the background), ``client`` (HTTP helpers) and ``widgets`` (ipywidgets).
Their packages come with the ``lab`` extra, and no server imports them (``tests/test_layout.py``).

The printed words are ``words``' (``tr``, ``pad``, ``table``, ``large_number``), named here too, so a notebook cell
writes ``from llmkit.course import tr``.
"""

from __future__ import annotations

from llmkit.course.words import large_number, pad, table, tr

__all__ = ["large_number", "pad", "table", "tr"]
