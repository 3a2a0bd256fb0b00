"""Condense `pip install -v` output into a readable progress display.

The first install compiles llama.cpp (llama-cpp-python has no CPU wheel on
PyPI for every platform): several minutes with nothing on screen otherwise.
This filter reads pip's verbose output on stdin, writes all of it to a log
file, and shows only pip's own headlines plus one updating line for the
compiler's "[n/total]" steps.

Usage: pip install -v ... 2>&1 | python scripts/install_progress.py LOGFILE
"""

import re
import sys

STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]")
HEADLINE = re.compile(r"^(Building wheel|Successfully installed|ERROR|error:)")


def main() -> None:
    log_path = sys.argv[1]
    last_step = ""
    with open(log_path, "w") as log:
        for line in sys.stdin:
            log.write(line)
            step = STEP.match(line)
            if step:
                done, total = int(step[1]), int(step[2])
                last_step = f"\r  compiling llama.cpp: {done}/{total} ({100 * done // total}%)"
                sys.stdout.write(last_step)
                sys.stdout.flush()
            elif HEADLINE.match(line):
                if last_step:
                    sys.stdout.write("\n")
                    last_step = ""
                sys.stdout.write(line if len(line) < 200 else line[:200] + "...\n")
                sys.stdout.flush()
    if last_step:
        sys.stdout.write("\n")


if __name__ == "__main__":
    main()
