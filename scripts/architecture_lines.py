"""Fill docs/architecture.md's code references: @@file:text@@ -> `file:line` of text's first line.

python scripts/architecture_lines.py scripts/architecture.in.md > docs/architecture.md
"""

import re
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "dapo"


def where(ref: str) -> str:
    file, _, text = ref.partition(":")
    for number, line in enumerate((SRC / file).read_text().splitlines(), 1):
        if text in line:
            return f"`{file}:{number}`"
    sys.exit(f"not found: {text!r} in {file}")


print(re.sub(r"@@(.+?)@@", lambda m: where(m.group(1)), Path(sys.argv[1]).read_text()), end="")
