"""Code features of executed cells: language detection, code patterns, success and quality.

Python code is read with `ast` where it parses (exact counts); SQL, JavaScript and Python
that does not parse are read with patterns.
"""

from __future__ import annotations

import ast
import difflib
import re

from capibara_exp.data.e2b.records import ExecutionRecord, split_expected

_LANG_PATTERNS = {
    "python": [
        r"^\s*def \w+\(.*\):",
        r"^\s*import \w+",
        r"^\s*from [\w.]+ import ",
        r"\bprint\(",
        r"^\s*(for|while|if|elif|with)\b.*:\s*$",
        r"\bself\b",
        r"\bNone\b|\bTrue\b|\bFalse\b",
        r"^\s*class \w+.*:",
        r"\blambda\b",
        r"\bnp\.\w+",
    ],
    "sql": [
        r"(?i)\bselect\b.+\bfrom\b",
        r"(?i)\binsert\s+into\b",
        r"(?i)\bcreate\s+(table|index|view)\b",
        r"(?i)\bupdate\s+\w+\s+set\b",
        r"(?i)\bdelete\s+from\b",
        r"(?i)\bwhere\b",
        r"(?i)\bjoin\b",
        r"(?i)\bdrop\s+table\b",
        r"(?i)\bvalues\s*\(",
    ],
    "javascript": [
        r"\b(const|let|var)\s+\w+\s*=",
        r"=>",
        r"\bfunction\s*\w*\s*\(",
        r"\bconsole\.\w+\(",
        r"\brequire\(['\"]",
        r"^\s*import .* from ['\"]",
        r"===|!==",
        r"\bawait\b",
        r"\bmodule\.exports\b",
        r";\s*$",
    ],
}
_SQL = {
    "sql_joins": r"(?i)\bjoin\b",
    "sql_aggregates": r"(?i)\b(count|sum|avg|min|max|group_concat)\s*\(",
    "sql_group_by": r"(?i)\bgroup\s+by\b",
    "sql_subqueries": r"(?i)\(\s*select\b",
    "sql_ddl": r"(?i)\b(create|drop|alter)\s+(table|index|view|trigger)\b",
    "sql_writes": r"(?i)\b(insert|update|delete|replace)\b",
    "sql_order_by": r"(?i)\border\s+by\b",
    "sql_transactions": r"(?i)\b(begin|commit|rollback|savepoint)\b",
}
_JS = {
    "functions": r"\bfunction\b|=>",
    "classes": r"\bclass\s+\w+",
    "loops": r"\b(for|while)\s*\(|\.forEach\(",
    "imports": r"\brequire\(|^\s*import\s",
    "async": r"\basync\b|\bawait\b|\.then\(|Promise",
    "comprehensions": r"\.(map|filter|reduce)\(",
    "exceptions": r"\btry\s*{|\bcatch\b|\bthrow\b",
}
_GENERIC = {
    "functions": r"\bfunction\b|^\s*\w+\s*\(\)\s*\{|<-\s*function\b|\bdef\s|\bfn\s",
    "loops": r"^\s*(for|while|until)\b|\b(lapply|sapply|vapply|map)\(",
    "conditionals": r"^\s*(if|elif|else if|case)\b",
    "imports": r"^\s*(library|require|source|import|use)\b|^\s*\.\s+\S",
}
_PY_REGEX = {
    "functions": r"^\s*def ",
    "classes": r"^\s*class ",
    "loops": r"^\s*(for|while) ",
    "imports": r"^\s*(import|from) ",
    "comprehensions": r"\[[^\]]+ for [^\]]+ in ",
    "exceptions": r"^\s*(try|except)\b",
    "async": r"\basync\b|\bawait\b",
}


def detect_language(code: str) -> str:
    """The language whose patterns match most lines of the code (ties: python, sql, js)."""
    scores = {
        lang: sum(bool(re.search(p, code, re.M)) for p in pats)
        for lang, pats in _LANG_PATTERNS.items()
    }
    try:
        ast.parse(code)
        scores["python"] += 2  # it parses as Python: strong evidence
    except (SyntaxError, ValueError, RecursionError):  # RecursionError: `1+1+...` x 1e5
        pass
    return max(scores, key=lambda lang: (scores[lang], -list(scores).index(lang)))


def _python_features(code: str) -> dict[str, int] | None:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError):  # RecursionError: `1+1+...` x 1e5
        return None
    kinds = {
        "functions": (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda),
        "classes": (ast.ClassDef,),
        "loops": (ast.For, ast.While, ast.AsyncFor),
        "imports": (ast.Import, ast.ImportFrom),
        "comprehensions": (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp),
        "exceptions": (ast.Try, ast.Raise),
        "async": (ast.AsyncFunctionDef, ast.Await),
        "conditionals": (ast.If, ast.IfExp),
        "calls": (ast.Call,),
    }
    nodes = list(ast.walk(tree))
    return {name: sum(isinstance(n, types) for n in nodes) for name, types in kinds.items()}


def code_features(code: str, language: str) -> dict[str, int]:
    """Counts of code patterns (functions, classes, loops, imports, SQL joins...) and size."""
    feats: dict[str, int] = {"lines": code.count("\n") + 1, "chars": len(code)}
    if language == "python":
        feats.update(
            _python_features(code)
            or {k: len(re.findall(p, code, re.M)) for k, p in _PY_REGEX.items()}
        )
    elif language == "sql":
        feats.update({k: len(re.findall(p, code)) for k, p in _SQL.items()})
        feats["statements"] = code.count(";") or 1
    elif language in ("javascript", "typescript", "java"):
        feats.update({k: len(re.findall(p, code, re.M)) for k, p in _JS.items()})
    else:  # bash, R and any other language: the constructs most languages share
        feats.update({k: len(re.findall(p, code, re.M)) for k, p in _GENERIC.items()})
    return feats


_MATCH_CHARS = 8000


def _normalise_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.replace("<BLANKLINE>", "").strip().splitlines())


def expected_match(record: ExecutionRecord) -> float | None:
    """How closely the output matches the documented output (doctests), 0..1; None if none."""
    if record.expected_output is None:
        return None
    expected = record.expected_output
    if record.raised_as_expected:  # the traceback is matched by the error, not the output
        expected = split_expected(expected)[0]
    want, got = _normalise_output(expected), _normalise_output(record.output_text)
    if want == got:
        return 1.0
    # SequenceMatcher is quadratic: long outputs are compared on their first characters
    want, got = want[:_MATCH_CHARS], got[:_MATCH_CHARS]
    return difflib.SequenceMatcher(None, want, got, autojunk=False).ratio()


def quality_score(record: ExecutionRecord, feats: dict[str, int]) -> float:
    """0..1: ran cleanly, showed the documented output, has structure, a useful size."""
    match = expected_match(record)
    structure = sum(
        v > 0 for k, v in feats.items() if k not in ("lines", "chars", "calls", "statements")
    )
    score = 0.35 * record.succeeded
    score += 0.25 * (
        match if match is not None else float(record.succeeded and bool(record.output_text))
    )
    score += 0.15 * min(1.0, structure / 3)
    score += 0.15 * (40 <= feats["chars"] <= 2000)
    score += 0.10 * (not record.execution.logs.stderr)
    return round(score, 4)


def difficulty_bucket(feats: dict[str, int], succeeded: bool) -> str:
    """easy / medium / hard from the code's size and the variety of constructs it uses."""
    structure = sum(v > 0 for k, v in feats.items() if k not in ("lines", "chars", "calls"))
    points = (feats["lines"] > 6) + (feats["lines"] > 20) + (structure >= 2) + (structure >= 4)
    points += not succeeded
    return "easy" if points <= 1 else "medium" if points <= 3 else "hard"
