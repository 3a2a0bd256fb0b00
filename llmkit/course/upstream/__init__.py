"""The real llama-server beside llmkit: its source of the pinned version, read by name, and its binary.

    from llmkit.course import upstream
    upstream.root()                             # llama.cpp of the installed llama-cpp-python (fetched once)
    upstream.find("get_available_slot")         # -> Symbol: file, lines, text; highlighted in a notebook
    upstream.server_binary()                    # llama-server built from that source (once, ~7 min on 2 cores)
    upstream.MAP                                # llmkit symbol <-> llama-server symbol, with what differs

Modules: ``source`` (fetch and check), ``cpp`` (tree-sitter lookup),
``build`` (cmake + ninja), ``mapping`` (the map).
"""

from llmkit.course.upstream.build import server_binary
from llmkit.course.upstream.cpp import SideBySide, Symbol, count_lines, find, find_all, side_by_side
from llmkit.course.upstream.mapping import MAP, Counterpart, counterparts, llmkit_symbol
from llmkit.course.upstream.source import UpstreamError, root, version

__all__ = [
    "MAP", "Counterpart", "SideBySide", "Symbol", "UpstreamError",
    "count_lines", "counterparts", "find", "find_all", "llmkit_symbol", "side_by_side", "root", "server_binary", "version",
]  # fmt: skip
