import sys

from llmkit.cli import main

sys.exit(main())
