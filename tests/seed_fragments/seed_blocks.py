"""Reads the code blocks out of the seed documents (../shared/seeds/*.txt: Markdown
fences and reStructuredText ``.. code-block::`` directives) and the verbatim part of
each fragment file, so tests can check that the fragments are the users' lines."""
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# A copy of the project's seed documents (../shared/seeds), kept in the repository so a
# fresh checkout (CI) checks the fragments against them; tests/test_seed_fragments.py
# checks the copy against ../shared/seeds where that exists.
SEEDS = HERE / "seeds"
SHARED_SEEDS = REPO.parent / "shared" / "seeds"
BEGIN = "# ---- BEGIN seed fragment (verbatim) ----"
END = "# ---- END seed fragment ----"

_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_DIRECTIVE = re.compile(r"^(\s*)\.\. code-block::\s*(\w*)\s*$")


@dataclass
class Block:
    seed: str      # file name, e.g. 003_96f08bc267ccd6d9.txt
    line: int      # 1-based line of the first code line
    language: str  # "python", or "" when the block does not say
    code: str      # dedented, without trailing blank lines


def _dedent(lines: List[str], indent: int) -> str:
    out = [ln[indent:] if ln[:indent].strip() == "" else ln for ln in lines]
    while out and not out[-1].strip():
        out.pop()
    return "\n".join(ln.rstrip("\n") for ln in out)


def blocks(path: Path) -> List[Block]:
    """Every code block of one seed document, in order."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence, directive = _FENCE.match(lines[i]), _DIRECTIVE.match(lines[i])
        if fence:
            indent, lang, j = len(fence.group(1)), fence.group(2), i + 1
            while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
                j += 1
            found.append(Block(path.name, i + 2, lang, _dedent(lines[i + 1:j], indent)))
            i = j + 1
        elif directive:
            base, lang, j = len(directive.group(1)), directive.group(2), i + 1
            while j < len(lines) and (not lines[j].strip() or
                                      lines[j].strip().startswith(":")):
                j += 1  # blank lines and directive options (:caption:, :name:)
            start = j
            while j < len(lines) and (not lines[j].strip() or
                                      len(lines[j]) - len(lines[j].lstrip()) > base):
                j += 1
            body = lines[start:j]
            indent = min(len(ln) - len(ln.lstrip()) for ln in body if ln.strip())
            found.append(Block(path.name, start + 1, lang, _dedent(body, indent)))
            i = j
        else:
            i += 1
    return found


def fragment_code(path: Path) -> Optional[str]:
    """The verbatim part of a fragment file (between BEGIN and END), or None."""
    text = path.read_text()
    if BEGIN not in text:
        return None
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return body.strip("\n").rstrip()
